"""How a head-style drafter grows its tree, level by level: static or dynamic.

Both policies speak one protocol, so the drafter's loop does not branch on the
tree kind::

    feed = policy.start(root, logp_root [V])     # Feed | None
    while feed is not None:                      # run the head on feed.tokens
        feed = policy.grow(logp [F, V])          # next level, or None when done
    tree = policy.finish()
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eyas.tree import DynamicTreeBuilder, DynamicTreeConfig, Frontier, StaticTree
from eyas.tree.budget import StepBudget
from eyas.types import Tree


@dataclass
class Feed:
    """Nodes the head runs next (F of them, all at one depth)."""

    # [F] long, token of each node (target ids)
    tokens: torch.Tensor
    # [F] long, row of the previous feed's output that is each node's parent (root: row 0)
    parent_rows: torch.Tensor
    # [F, fed + F] bool, visibility over all nodes fed so far (this feed last)
    mask: torch.Tensor
    depth: int

    @property
    def seen(self) -> list[list[int]]:
        """seen[f]: the fed entries node f attends, ascending (what the compiled head layer reads:
        eyas.drafters.head_kernels.HeadPaths).
        """
        return [[j for j, v in enumerate(row) if v] for row in self.mask.tolist()]

    @property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @property
    def parent_row_list(self) -> list[int]:
        return self.parent_rows.tolist()


class StaticExpansion:
    """EAGLE-1 / Medusa static tree: children are fixed top-k ranks of each node."""

    def __init__(self, template: StaticTree) -> None:
        self.t = template
        depth = template.depth
        self.max_depth = int(depth.max())
        has_children = template.children[:, 0] >= 0
        # nodes fed at each depth d >= 1 are the nodes of depth d that have children
        self.feeds = [((depth == d) & has_children).nonzero().flatten() for d in range(self.max_depth + 1)]
        self.fed_order = torch.cat(self.feeds[1:]) if self.max_depth > 1 else torch.empty(0, dtype=torch.long)
        self.levels = [(depth == d).nonzero().flatten() for d in range(self.max_depth + 1)]
        self.max_fed = int(self.fed_order.shape[0])
        self.max_nodes = template.num_nodes  # nodes of every tree, root included
        # [Vd] long: draft-vocabulary index -> target id (EAGLE-3); None = logp is over target ids
        self.id_map: torch.Tensor | None = None

    def start(self, root: torch.Tensor, logp: torch.Tensor) -> Feed | None:
        self.tokens = torch.zeros(self.t.num_nodes, dtype=torch.long)
        self.tokens[0] = root
        self.d = 0
        self.nfed = 0
        return self.grow(logp[None])

    def grow(self, logp: torch.Tensor) -> Feed | None:
        """logp: [F, V] at the nodes of the last feed (depth d). Fills depth d + 1."""
        d = self.d
        parents_fed = self.feeds[d] if d > 0 else torch.zeros(1, dtype=torch.long)
        kids = self.levels[d + 1]
        row_of = torch.full((self.t.num_nodes,), -1, dtype=torch.long)
        row_of[parents_fed] = torch.arange(parents_fed.shape[0])
        top = logp.topk(self.t.topk_per_depth[d], dim=-1).indices  # [F, k]
        top = (top if self.id_map is None else self.id_map[top]).cpu()  # host sync: tree books live on CPU
        self.tokens[kids] = top[row_of[self.t.parents[kids]], self.t.ranks[kids]]
        self.d = d + 1
        if self.d >= self.max_depth or self.feeds[self.d].numel() == 0:
            return None
        nodes = self.feeds[self.d]
        prev = self.feeds[d] if d > 0 else torch.zeros(1, dtype=torch.long)
        prow = torch.full((self.t.num_nodes,), 0, dtype=torch.long)
        prow[prev] = torch.arange(prev.shape[0])
        self.nfed += nodes.shape[0]
        mask = self.t.mask[nodes][:, self.fed_order[: self.nfed]]
        return Feed(tokens=self.tokens[nodes], parent_rows=prow[self.t.parents[nodes]], mask=mask, depth=self.d)

    def finish(self) -> Tree:
        return self.t.with_tokens(self.tokens)


class DynamicExpansion:
    """EAGLE-2: expand the best frontier by cumulative log-prob, then rerank.

    With a ``StepBudget`` (``--tree adaptive:...``) each step stops feeding levels once the frontier's path
    probabilities sum below the budget's ``feed`` and keeps as many nodes as its prices say pay
    (eyas.tree.budget); ``cfg.depth`` and ``cfg.total_tokens`` are then the most a step may use.
    """

    def __init__(self, cfg: DynamicTreeConfig, budget: StepBudget | None = None) -> None:
        self.cfg = cfg
        self.budget = budget
        # EYAS_FEED_RULE=best: the frontier's best path probability alone decides feeding (the rule before
        # 2026-12-01), for one-process A/Bs (scripts/head_ab.py --later-env)
        self.best_only = os.environ.get("EYAS_FEED_RULE", "sum") == "best"
        self.builder = DynamicTreeBuilder(cfg)
        self.max_fed = cfg.top_k * (cfg.depth - 1)
        self.max_nodes = cfg.total_tokens + 1  # kept draft tokens plus the root
        # [Vd] long: draft-vocabulary index -> target id (EAGLE-3); None = logp is over target ids
        self.id_map: torch.Tensor | None = None

    def _ids(self, idx: torch.Tensor) -> torch.Tensor:
        return (idx if self.id_map is None else self.id_map[idx]).cpu()

    def _feed(self, f: Frontier) -> Frontier | None:
        """The frontier is the feed (it has Feed's fields, each tensor made on first use); None past the last level,
        or (adaptive) once its nodes are too unlikely to be reached for another level to pay.
        """
        if f.depth >= self.cfg.depth:
            return None
        if self.budget is None:
            return f
        keys = self.builder.keys(f.slots)
        return f if self.budget.keep_feeding([max(keys)] if self.best_only else keys) else None

    def start(self, root: torch.Tensor, logp: torch.Tensor) -> Frontier | None:
        top = logp.topk(self.cfg.top_k)  # host sync below: tree books live on CPU
        return self.start_top(root, top.values.cpu(), self._ids(top.indices))

    def grow(self, logp: torch.Tensor) -> Frontier | None:
        top = logp.topk(self.cfg.top_k, dim=-1)
        return self.grow_top(top.values.cpu(), self._ids(top.indices))

    def start_top(self, root: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> Frontier | None:
        """``start`` from the root's top-k already taken: values [top_k] float log-probs, best first, and their
        target ids [top_k] long, on the CPU (the native head call's, eyas.drafters.head_step).
        """
        return self._feed(self.builder.start(root, values, ids))

    def grow_top(self, values: torch.Tensor, ids: torch.Tensor) -> Frontier | None:
        """``grow`` from each fed node's top-k already taken: values [F, top_k], ids [F, top_k] target ids (CPU)."""
        return self._feed(self.builder.expand(values, ids))

    def finish(self) -> Tree:
        return self.builder.finish(self.total()).tree

    def total(self, keys: list[float] | None = None) -> int:
        """Draft tokens this step keeps: the config's, or (adaptive) what the budget says pays for the ranked
        ``keys`` (default: the head's candidates, best first).
        """
        if self.budget is None:
            return self.cfg.total_tokens
        if keys is None:
            keys = self.builder.keys(self.builder.ranking()[: self.cfg.total_tokens])
        return min(self.budget.total(keys), self.cfg.total_tokens)


def make_expansion(tree: str | None, default: str = "dynamic"):
    """Parse --tree: 'dynamic[:top_k,depth,total]', 'adaptive:top_k,depth,feed,prices' (eyas.tree.budget),
    'static[:PRESET or choices]' or 'chain[:K]'.
    """
    from eyas.tree import parse_choices, static_tree

    spec = tree or default
    kind, _, arg = spec.partition(":")
    if kind == "dynamic":
        nums = [int(x) for x in arg.split(",")] if arg else []
        return DynamicExpansion(DynamicTreeConfig(*nums))
    if kind == "adaptive":
        b = StepBudget.parse(arg)
        most = DynamicTreeConfig(b.top_k, b.depth, 1).max_candidates
        return DynamicExpansion(DynamicTreeConfig(b.top_k, b.depth, min(b.max_total, most)), b)
    if kind == "static":
        return StaticExpansion(static_tree(parse_choices(arg or "eagle_small")))
    if kind == "chain":
        k = int(arg or 5)
        return StaticExpansion(static_tree([[0] * i for i in range(1, k + 1)]))
    raise ValueError(f"unknown tree {spec!r}; use dynamic[:TOP_K,DEPTH,TOTAL], adaptive:TOP_K,DEPTH,FEED,PRICES, "
                     "static[:PRESET|CHOICES] or chain[:K]")
