"""A draft tree sized step by step from the drafter's own confidence (``--tree adaptive:...``).

A fixed EAGLE-2 tree (``dynamic:top_k,depth,total``) spends the same verify rows and draft levels
on every step. On a CPU each verify row and each head level has a price (the sizer's cost table),
and the head's confidence says how much a step's candidates are worth: when its best guess has
path probability 0.95, another level will probably be accepted; at 0.2 it will probably not. So
each step decides, from the candidates it has:

* **depth**: after each level, feed the next one only while the frontier's path probabilities sum to at
  least ``feed`` (``keep_feeding``): each frontier node is reached with its probability p and then
  drafts a child, so a level is worth about ``q * sum(p)`` tokens (q the head's accuracy past the
  root). Until 2026-12-01 only the frontier's best p counted, which stopped wide trees early: with
  verify rows free (a GPU's cost shape) replayed 2.42x -> 2.70x, where the best node alone had left
  the adaptive tree 11 % behind the best fixed one; in real decoding on the Zen 4 VM neutral
  (0.984-1.011x, τ +2-4 %: its extra levels cost what they add; docs/benchmarks.md).
  ``EYAS_FEED_RULE=best`` keeps the old rule (eyas.drafters.expansion);
* **nodes**: keep the ``n`` best-ranked candidates that maximise ``sum(p_1 .. p_n) - price[n]``, where
  ``p_i`` is a candidate's path probability (exp of its ranking key: the expected tokens it adds)
  and ``price[n]`` the expected tokens the step must buy back to pay for ``n`` drafted rows
  (``total``).

Both are set by ``eyas.tree.sizing.step_budget`` from the machine's costs: ``price[n] = rate *
(forward(n + 1) - forward(1))`` and ``feed = rate * (level + row) / q``, with ``rate`` the tokens per
second the best fixed tree is predicted to make, ``level`` one head level's cost, ``row`` the mean cost
of a verify row and ``q`` the head's depth-2 top-1 acceptance (a level pays when its best node is
likely to be reached and then likely right). Measured by replaying the shipped head over 48 held-out
MT-Bench-101 texts on the Zen 5 cost table: 1.59x predicted against 1.52x for the best fixed tree
(docs/benchmarks.md). The draft's probabilities are under-confident here (p 0.3 -> 0.45 accepted), so
using them as they are errs towards small trees.

Lossless whatever it keeps: the tree is still a ranking prefix of the head's candidates.

    budget = StepBudget.parse("2,6,0.42,0.16/0.16/0.3/0.45")  # top_k 2, depth <= 6, 4 draft tokens at most
    budget.keep_feeding([math.log(0.3), math.log(0.2)])   # True: 0.5 >= 0.42
    budget.total([-0.05, -0.9, -1.6, -2.5])  # 3: p = .95, .41, .20 each earn their row, .08 does not
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudget:
    """Per-step tree size (see the module docstring)."""

    top_k: int  # children per expanded node, as in dynamic:top_k,...
    depth: int  # deepest draft level allowed
    feed: float  # feed the next level while the frontier's path probabilities sum to >= feed
    prices: tuple[float, ...]  # prices[n - 1]: expected tokens n drafted rows must return; len = most drafts kept

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or not self.prices:
            raise ValueError(f"an adaptive tree needs top_k >= 1, depth >= 1 and at least one price, got {self}")
        if not 0 <= self.feed <= 1 or any(p < 0 or not math.isfinite(p) for p in self.prices):
            raise ValueError(f"adaptive tree: feed must be in [0, 1] and prices finite and >= 0, got {self}")

    @property
    def max_total(self) -> int:
        """Most draft tokens a step keeps (root excluded)."""
        return len(self.prices)

    def keep_feeding(self, frontier_keys: list[float]) -> bool:
        """Whether to feed the next level, given the frontier's ranking keys (log path probabilities): while their
        probabilities sum to at least ``feed``.
        """
        return self.feed <= 0 or sum(math.exp(k) for k in frontier_keys) >= self.feed

    def total(self, keys: list[float]) -> int:
        """Draft tokens to keep, given the candidates' ranking keys best first (log path probabilities).

        The first n maximising sum(exp(keys[:n])) - prices[n - 1]; at least 1, at most ``max_total`` and
        the candidates there are.
        """
        if not keys:
            raise ValueError("no candidates to keep")
        best, n, gain = -math.inf, 1, 0.0
        for i, (k, price) in enumerate(zip(keys, self.prices, strict=False), start=1):
            gain += math.exp(k)
            if gain - price > best + 1e-12:
                best, n = gain - price, i
        return n

    @property
    def spec(self) -> str:
        """The --tree value: ``adaptive:TOP_K,DEPTH,FEED,PRICE1/PRICE2/...``."""
        prices = "/".join(f"{p:.3g}" for p in self.prices)
        return f"adaptive:{self.top_k},{self.depth},{self.feed:.3g},{prices}"

    @classmethod
    def parse(cls, arg: str) -> StepBudget:
        """``TOP_K,DEPTH,FEED,PRICE1/PRICE2/...`` (what follows ``adaptive:``) -> StepBudget."""
        parts = arg.split(",")
        try:
            if len(parts) != 4:
                raise ValueError
            return cls(int(parts[0]), int(parts[1]), float(parts[2]), tuple(float(p) for p in parts[3].split("/")))
        except ValueError as e:
            detail = f" ({e})" if str(e) else ""
            raise ValueError(
                f"--tree adaptive:{arg} is not TOP_K,DEPTH,FEED,PRICE1/PRICE2/... (e.g. adaptive:2,6,0.4,"
                "0.16/0.16/0.3/0.45: top-k 2, depth <= 6, feed a level while its frontier's path probabilities sum "
                f"to >= 0.4, at most 4 drafts, each priced in tokens){detail}") from None
