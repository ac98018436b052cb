"""Speculation by load: how wide a tree to verify per row, from measured costs and acceptance.

With B rows in a batch, verifying trees cut to their first ``w`` nodes costs one target
forward over B * w tokens plus the drafting, and yields ``tau(w)`` tokens per row. The
policy picks, before every batched step, the width with the most tokens per second:

    rate(w) = B * tau(w) / (cost(B * n(w), B) + B * draft_cost * [w > 1])      w = 1 is plain decoding

Everything on the right is measured, none of it assumed:

* ``cost(n, B)``: seconds per step with n tokens in the forward over B rows: the forward
  measured by a calibration at start (one forward per n = 1, 2, 4, ...), plus a per-row
  host overhead learnt from real steps (EMA);
* ``tau(w)``: mean tokens per step had the trees been cut to w nodes. Nodes are in
  topological order, so the accepted path's node indices increase and a cut at w keeps
  exactly the accepted nodes with index < w: every verified step measures tau(w) for all
  w up to its width at once (a counterfactual that is exact for greedy verification);
* ``draft_cost``: seconds per row to propose a tree (EMA);
* ``n(w)``: tokens per row in the forward, w for a drafter whose trees are always full, fewer for one that sizes
  its trees per step (eyas.tree.budget): the expected widest row of B, each min(w, its tree), from the sizes seen.

At low load drafting pays and trees stay full; as B grows the forward leaves the flat,
memory-bound part of ``cost`` and the policy narrows the trees, then drops to plain
decoding. One step in ``explore_every`` verifies full trees, so tau(w) stays fresh for
every w (a cut tree measures tau only up to its cut).
Cutting a tree never changes outputs: a cut tree is still a valid tree (lossless).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PolicyConfig:
    # "auto": measured widths as above; "always": full trees; "never": plain decoding
    mode: str = "auto"
    ema: float = 0.1  # weight of a new observation
    min_observations: int = 8  # verified steps before tau(w) is trusted (until then: full trees)
    explore_every: int = 32  # verify full trees on one step in this many (keeps tau(w) fresh)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never"):
            raise ValueError(f"speculation policy must be auto, always or never, got {self.mode!r}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")


class CostTable:
    """Seconds per step: a forward over n tokens (piecewise linear) plus a per-row overhead.

    Calibrated tables (``fixed``) keep their measured forward shape, and real steps teach
    only the per-row host overhead (verification, commit, detokenising: what one forward of
    n tokens on one row does not have); an uncalibrated table learns step times per n.
    """

    def __init__(self, points: dict[int, float] | None = None, ema: float = 0.1, fixed: bool = False) -> None:
        self.points = dict(points or {})
        self.ema, self.fixed = ema, fixed
        self.per_row = 0.0  # seconds per row per step beyond the forward (fixed tables only)

    def __call__(self, n: int, rows: int = 1) -> float:
        return self.forward(n) + rows * self.per_row

    def forward(self, n: int) -> float:
        if not self.points:
            return float(n)  # nothing measured: proportional to tokens (only ratios matter)
        xs = sorted(self.points)
        if n in self.points:
            return self.points[n]
        i = bisect_left(xs, n)
        if i == 0:
            return self.points[xs[0]]
        if i == len(xs):  # beyond the largest point: extend the last segment's slope
            if len(xs) == 1:
                return self.points[xs[0]] * n / xs[0]
            x0, x1 = xs[-2], xs[-1]
        else:
            x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.points[x0], self.points[x1]
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)

    def observe(self, n: int, rows: int, seconds: float) -> None:
        if self.fixed:
            extra = max(seconds - self.forward(n), 0.0) / rows
            self.per_row = (1 - self.ema) * self.per_row + self.ema * extra
            return
        old = self.points.get(n)
        self.points[n] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds


class AcceptanceCurve:
    """tau(w) for w = 1 .. max_nodes: decayed mean tokens per step with trees cut to w nodes; and how large the
    drafted trees are (a drafter that sizes its trees per step, eyas.tree.budget, often drafts fewer than w nodes).
    """

    def __init__(self, max_nodes: int, ema: float) -> None:
        self.max_nodes, self.ema = max_nodes, ema
        self.tau = [1.0] * (max_nodes + 1)  # index w; tau[1] = 1 (plain) by definition
        self.seen = [0] * (max_nodes + 1)
        # size[n]: decayed share of drafted trees with n nodes; until one is seen, every tree is full
        self.size = [0.0] * max_nodes + [1.0]
        self.sizes_seen = 0

    def observe(self, tree_nodes: int, cut: int, path: list[int]) -> None:
        """tree_nodes: drafted tree size; cut: the width it was cut to (max_nodes: not cut); path: accepted nodes.

        A cut at w is known for every w <= cut. Widths past the cut are left to the steps that verify full trees:
        counting the trees that happened to fit under the cut there (small, unsure ones) and not the others would
        bias tau(w) low for the widths the policy does not use.
        """
        for w in range(2, min(cut, self.max_nodes) + 1):
            value = 1.0 + sum(1 for p in path[1:] if p < w)
            a = max(self.ema, 1.0 / (self.seen[w] + 1))  # plain mean until the EMA takes over
            self.tau[w] = (1 - a) * self.tau[w] + a * value
            self.seen[w] += 1
        a = max(self.ema, 1.0 / (self.sizes_seen + 1))
        self.size = [(1 - a) * p for p in self.size]
        self.size[max(1, min(tree_nodes, self.max_nodes))] += a
        self.sizes_seen += 1

    def tokens(self, w: int, rows: int) -> float:
        """Expected tokens per row in a forward of ``rows`` rows whose trees are cut to ``w``: rows are padded to the
        widest, so E[max over rows of min(w, size)] = sum over m <= w of P(some row keeps >= m nodes).
        """
        out, below = 0.0, 0.0  # below: P(size < m)
        for m in range(1, w + 1):
            out += 1.0 - below**rows
            below += self.size[m]
        return out


class SpecPolicy:
    """Chooses the verify width for a batch of B rows; see the module docstring."""

    def __init__(self, max_nodes: int, cfg: PolicyConfig | None = None, cost: CostTable | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        self.max_nodes = max_nodes
        self.cost = cost or CostTable(ema=self.cfg.ema)
        self.curve = AcceptanceCurve(max_nodes, self.cfg.ema)
        self.draft_cost = 0.0
        self.widths = sorted({1, max_nodes} | {w for w in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if w < max_nodes})
        self._steps = 0
        self.last_width = max_nodes

    def width(self, batch: int) -> int:
        """Nodes per row to verify in the next step (1 = no drafting)."""
        mode = self.cfg.mode
        if mode != "auto" or self.max_nodes == 1:
            w = 1 if mode == "never" else self.max_nodes
        elif self.curve.seen[self.max_nodes] < self.cfg.min_observations:
            w = self.max_nodes  # learn tau(w) for every w first
        else:
            self._steps += 1
            # one step in explore_every verifies full trees: a cut tree only measures tau up
            # to its cut, so without this the wider widths' estimates would never refresh
            explore = self._steps % self.cfg.explore_every == 0
            w = self.max_nodes if explore else self.best(batch)
        self.last_width = w
        return w

    def rate(self, batch: int, w: int) -> float:
        """Predicted tokens per second for ``batch`` rows verifying trees cut to ``w`` nodes."""
        draft = batch * self.draft_cost if w > 1 else 0.0
        tokens = batch * self.curve.tokens(w, batch) if w > 1 else batch
        return batch * self.curve.tau[w] / max(self.cost(tokens, batch) + draft, 1e-9)

    def observe_draft(self, seconds_per_row: float) -> None:
        a = self.cfg.ema
        self.draft_cost = seconds_per_row if self.draft_cost == 0.0 else (1 - a) * self.draft_cost + a * seconds_per_row

    def best(self, batch: int) -> int:
        """The width ``width`` would pick for ``batch`` rows in auto mode, without exploring."""
        return max(self.widths, key=lambda w: self.rate(batch, w))

    def snapshot(self, batch: int, max_batch: int | None = None) -> dict:
        """The policy's current view (``GET /v1/eyas/policy``, logs)."""
        return {
            "mode": self.cfg.mode,
            "last_width": self.last_width,
            "draft_ms_per_row": round(1000 * self.draft_cost, 3),
            "tau": {w: round(self.curve.tau[w], 3) for w in self.widths},
            "tau_observations": {w: self.curve.seen[w] for w in self.widths},
            "forward_ms_by_tokens": {n: round(1000 * v, 2) for n, v in sorted(self.cost.points.items())},
            "overhead_ms_per_row": round(1000 * self.cost.per_row, 3),
            "predicted_tok_s": {w: round(self.rate(batch, w), 2) for w in self.widths},
            "best_width_by_batch": {b: self.best(b) for b in range(1, (max_batch or batch) + 1)},
        }


def calibrate(forward: Callable[[int], None], max_tokens: int, repeats: int = 3) -> CostTable:
    """Time ``forward(n)`` for n = 1, 2, 4, ... up to ``max_tokens``: best of ``repeats``.

    One untimed sweep first (first calls pay for allocation and kernel selection), then the
    table is made non-decreasing from the right: more tokens never cost less, so a smaller
    n measured slower than a larger one was noise.
    """
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)
    for n in sizes:
        forward(n)
    points = {}
    for n in sizes:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(n)
            best = min(best, time.perf_counter() - t0)
        points[n] = best
    low = float("inf")
    for n in reversed(sizes):
        low = points[n] = min(points[n], low)
    return CostTable(points, fixed=True)
