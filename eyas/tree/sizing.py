"""A draft tree sized to the hardware: pick top-k, depth and total nodes maximising predicted tokens/s.

Pure and deterministic: given a measured cost table and a head's acceptance profile it always
returns the same choice (ties go to the smaller tree). Measuring lives in ``eyas.autotree``.

**Acceptance model.** ``rank_accept[d][r]`` is the probability that the target's token at depth
``d + 1`` is the head's rank-``r`` proposal, given that the path above it was drafted correctly
(measured teacher-forced, ``scripts/acceptance_profile.py``). A node reached by ranks
``r_1 .. r_d`` is accepted with probability ``prod_i rank_accept[i - 1][r_i]`` (depths taken as
independent), and a tree's expected tokens per step is ``tau = 1 + sum over its nodes``.

**The tree the head builds.** EAGLE-2 (``eyas.tree.dynamic``) with these probabilities as
scores: the root's top-k children, then ``depth - 1`` expansions of the k best nodes of the
last level, k children each; the ``total`` best candidates are kept (ancestor-closed, since
probabilities never grow along a path). ``predicted_tau`` mirrors exactly that.

**Measured τ by tree.** That model takes depths as independent and weighs every position alike, and
runs high, most for chains (a dynamic tree spends its nodes where *this* step is uncertain, which the
averages miss): on the shipped head's tuning questions +0.09 to +0.17 τ for chains of 2-4, +0.03 to
+0.05 for top-k 2-4 trees. A profile can carry ``tree_tau``: τ of each (top_k, depth, total) replayed
from the drafter itself over greedy texts (``eyas.tree_replay``). When present, it is used as it
stands and the search covers exactly its trees.

**Cost of a step** (seconds)::

    step(k, depth, total) = forward(total + 1)                       verify forward, root included
                          + per_step + (depth - 1) * (per_level + k * per_node)     drafting

and the choice maximises ``tau / step`` over ``top_k <= max_top_k``, ``depth <= len(profile)``,
``total + 1 <= max_nodes``. Plain decoding makes ``1 / forward(1)`` tokens/s, reported alongside.
A second source sharing the tree (the hybrid drafter's lookup chains) adds its measured
``extra_tau(total + 1)`` to tau.

**Sized step by step.** ``step_budget`` turns the best fixed tree's costs and rate into an adaptive tree
(``eyas.tree.budget``): each step feeds levels and keeps nodes only while the head's own probabilities say they
pay at that rate. The fixed tree's prediction stays what ``TreeChoice`` reports.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import asdict, dataclass

from eyas.tree.budget import StepBudget

# most draft tokens an adaptive tree keeps on a CPU (eyas.autotree.adaptive_max_total): past 8 nodes a verify row
# costs ~0.9 ms on the Zen 5 VM, which the head's candidates there (path probability < 0.1) do not return
ADAPTIVE_MAX_TOTAL = 7


@dataclass
class AcceptanceProfile:
    """A head's acceptance by depth and rank (see the module docstring)."""

    # [depth][rank] probability, rows for depth 1, 2, ...; each row sums to <= 1
    rank_accept: list[list[float]]
    # (top_k, depth, total) -> measured tokens per step (eyas.tree_replay); None: the model above only
    tree_tau: dict[tuple[int, int, int], float] | None = None

    def __post_init__(self) -> None:
        measured = self.tree_tau or {}
        self.tree_tau = {tuple(int(x) for x in k): float(v) for k, v in measured.items()} or None
        bad = [k for k, v in (self.tree_tau or {}).items() if len(k) != 3 or min(k) < 1 or v < 1]
        if bad:
            raise ValueError(f"tree_tau needs (top_k, depth, total) >= 1 keys and tau >= 1, got {bad[:3]}")
        rows = self.rank_accept = [[float(p) for p in row] for row in self.rank_accept]
        if not rows or not all(rows):
            raise ValueError("an acceptance profile needs at least one depth with at least one rank")
        for d, row in enumerate(rows, start=1):
            if any(p < 0 for p in row) or sum(row) > 1 + 1e-6:
                raise ValueError(f"rank_accept at depth {d} must be probabilities summing to <= 1, got {row}")


@dataclass
class DraftCost:
    """Seconds the drafter spends per step (see the module docstring)."""

    per_step: float = 0.0  # whatever the tree: root logits, extending over the accepted tokens, books
    per_level: float = 0.0  # per expansion (one head forward over k nodes)
    per_node: float = 0.0  # per node fed in an expansion


@dataclass
class TreeChoice:
    """The chosen tree and what it is predicted to do."""

    top_k: int
    depth: int
    total_tokens: int  # draft tokens kept (nodes - 1)
    predicted_tau: float
    predicted_tok_s: float
    plain_tok_s: float  # plain decoding on the same cost table
    step_ms: float  # predicted seconds per speculative step, in ms
    tau_source: str = "model"  # "measured": the profile's tree_tau (eyas.tree_replay); "model": rank_accept
    # sized step by step from this fixed tree's costs and rate (``step_budget``); None: the fixed tree itself
    budget: StepBudget | None = None

    @property
    def fixed_spec(self) -> str:
        """The --tree value of the best fixed tree (what the prediction is for)."""
        return f"dynamic:{self.top_k},{self.depth},{self.total_tokens}"

    @property
    def spec(self) -> str:
        """The --tree value of this choice: the adaptive tree where there is a budget, else the fixed one."""
        return self.budget.spec if self.budget is not None else self.fixed_spec

    def to_dict(self) -> dict:
        d = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items() if k != "budget"}
        return {"tree": self.spec, "fixed_tree": self.fixed_spec, **d,
                "predicted_speedup": round(self.predicted_tok_s / self.plain_tok_s, 4)}


def step_budget(choice: TreeChoice, cost: dict[int, float], draft: DraftCost, profile: AcceptanceProfile,
                max_total: int = ADAPTIVE_MAX_TOTAL) -> StepBudget:
    """The adaptive tree (eyas.tree.budget) priced from the machine's costs and the best fixed tree's rate.

    ``price[n] = rate * (forward(n + 1) - forward(1))``: the tokens n drafted rows must return to pay for their
    share of the verify forward at the rate the fixed tree makes. ``feed = rate * (level + row) / q``: a level costs
    a head forward over k nodes (``draft``) and, if its nodes are kept, about a row each (the table's mean from 1
    to ``max_total + 1`` nodes); it pays when the frontier's nodes (probabilities p) are reached and their children
    are right (the head's depth-2 top-1 acceptance q), so it is fed while q * sum(p) >= rate * (level + row). Top-k is
    the fixed tree's, at least 2 (a chain has no sibling to keep when the head is unsure); depth up to the
    profile's.
    """
    k = max(choice.top_k, 2)
    rate = choice.predicted_tok_s
    base = interpolate(cost, 1)
    prices = tuple(round(rate * (interpolate(cost, n + 1) - base), 4) for n in range(1, max_total + 1))
    level = draft.per_level + k * draft.per_node
    row = (interpolate(cost, max_total + 1) - base) / max_total
    rows = profile.rank_accept
    q = rows[1][0] if len(rows) > 1 and rows[1][0] > 0 else rows[0][0]
    feed = min(1.0, round(rate * (level + row) / max(q, 1e-6), 4))
    return StepBudget(top_k=k, depth=len(rows), feed=feed, prices=prices)


def interpolate(cost: dict[int, float], n: int) -> float:
    """Seconds of a forward over n tokens from measured points: piecewise linear, flat below the
    smallest point, extended along the last segment above the largest.
    """
    xs = sorted(cost)
    if not xs:
        raise ValueError("the cost table is empty")
    if n in cost:
        return cost[n]
    i = bisect_left(xs, n)
    if i == 0:
        return cost[xs[0]]
    if i == len(xs):
        if len(xs) == 1:
            return cost[xs[0]] * n / xs[0]
        i -= 1
    x0, x1 = xs[i - 1], xs[i]
    return cost[x0] + (cost[x1] - cost[x0]) * (n - x0) / (x1 - x0)


def candidate_probs(profile: AcceptanceProfile, top_k: int, depth: int) -> list[float]:
    """Acceptance probability of every EAGLE-2 candidate for (top_k, depth), best first.

    Level 1 is the root's k children; each further level expands the k most probable nodes of
    the level above (ties: earlier node), k children each, ranks beyond the profile count 0.
    """
    def p(d: int, r: int) -> float:
        row = profile.rank_accept[d - 1]
        return row[r] if r < len(row) else 0.0

    level = [p(1, r) for r in range(top_k)]
    out = list(level)
    for d in range(2, depth + 1):
        frontier = heapq.nlargest(top_k, range(len(level)), key=lambda i, lv=level: (lv[i], -i))
        level = [level[f] * p(d, r) for f in frontier for r in range(top_k)]
        out += level
    return sorted(out, reverse=True)


def predicted_tau(profile: AcceptanceProfile, top_k: int, depth: int, total: int) -> float:
    """Expected tokens per step of the EAGLE-2 tree (top_k, depth, total) under ``profile``: its
    measured τ where the profile has one, else the independent-depth model.
    """
    if profile.tree_tau and (top_k, depth, total) in profile.tree_tau:
        return profile.tree_tau[top_k, depth, total]
    return 1.0 + sum(candidate_probs(profile, top_k, depth)[:total])


def _trees(profile: AcceptanceProfile, max_top_k: int, max_nodes: int):
    """(top_k, depth, total, tau) of every tree searched, smaller trees first within each (top_k, depth)."""
    if profile.tree_tau:
        for (k, depth, total), tau in sorted(profile.tree_tau.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
            if k <= max_top_k and total + 1 <= max_nodes:
                yield k, depth, total, tau
        return
    for depth in range(1, len(profile.rank_accept) + 1):
        for k in range(1, max_top_k + 1):
            tau = 1.0
            for total, pr in enumerate(candidate_probs(profile, k, depth)[: max_nodes - 1], start=1):
                tau += pr
                yield k, depth, total, tau


def choose_tree(cost: dict[int, float], draft: DraftCost, profile: AcceptanceProfile,
                max_top_k: int = 8, max_nodes: int | None = None,
                extra_tau: dict[int, float] | None = None) -> TreeChoice:
    """The (top_k, depth, total) with the most predicted tokens/s.

    Args:
        cost: seconds of one verify forward (a whole step of plain decoding at that width) by
            number of tokens in it, root included; measured widths, interpolated between.
        draft: the drafter's cost model.
        profile: the head's acceptance by depth and rank.
        max_top_k: largest top-k tried.
        max_nodes: largest tree tried, root included (default: the largest measured width).
        extra_tau: tokens per step added by another source sharing the tree, by its node count
            (the hybrid drafter's lookup chains, measured), interpolated; None: the head alone.
    """
    max_nodes = max_nodes or max(cost)
    best: tuple[float, int, int, int, float, float] | None = None
    for k, depth, total, tau in _trees(profile, max_top_k, max_nodes):
        drafting = draft.per_step + (depth - 1) * (draft.per_level + k * draft.per_node)
        step = interpolate(cost, total + 1) + drafting
        rate = (tau + (interpolate(extra_tau, total + 1) if extra_tau else 0.0)) / step
        # strictly better only: trees come small to large, so ties keep the smaller tree
        if best is None or rate > best[0] * (1 + 1e-9):
            best = (rate, k, depth, total, rate * step, step)
    if best is None:
        raise ValueError(f"no tree fits max_nodes={max_nodes}")
    rate, k, depth, total, tau, step = best
    return TreeChoice(top_k=k, depth=depth, total_tokens=total, predicted_tau=tau, predicted_tok_s=rate,
                      plain_tok_s=1.0 / interpolate(cost, 1), step_ms=1000 * step,
                      tau_source="measured" if profile.tree_tau else "model")
