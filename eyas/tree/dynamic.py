"""EAGLE-2 dynamic draft trees: expand by cumulative score, then rerank.

Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees"; reference code: SafeAILab/EAGLE ``Model.topK_genrate`` in
``eagle/model/cnets.py``. This module only keeps the books; the drafter runs
the model and hands in log-probs.

One draft step, with k = ``top_k``::

    builder.start(root, logp [k], tokens [k])     # root's top-k: depth-1 candidates
    repeat depth - 1 times:                        # frontier = k best of the last level
        feed frontier.tokens to the draft model (attention: frontier.mask)
        builder.expand(logp [k, k], tokens [k, k]) # each frontier node's top-k children
    result = builder.finish()                      # best total_tokens candidates + root

Candidates live in preallocated slots (static shapes): slot 0 is the root,
slots 1..k the depth-1 candidates, then k * k slots per expansion, row-major
(slot ``base + f * k + j`` is child j of frontier node f). A candidate's
*score* is its cumulative log-prob (sum along its path from the root).

``total_tokens`` counts draft tokens, not the root, as EAGLE's ``total_token``
does: the final tree has ``total_tokens + 1`` nodes. ``depth`` is the deepest
draft level, so there are ``depth - 1`` expansions; EAGLE's ``depth`` counts
expansions, so EAGLE ``depth=5`` is ``depth=6`` here.

Ancestors are always kept. Ranking uses ``key = min(score, parent's key)``,
which equals the score for log-probs (they are <= 0, so scores never increase
along a path) and makes any key non-increasing along a path in general. Ties
break towards the lower slot, and a parent's slot is below its children's, so a
parent always ranks before its children and every prefix of the ranking is a
valid tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.types import PAD_ID, Tree


@dataclass
class DynamicTreeConfig:
    """Shape of an EAGLE-2 dynamic tree (see the module docstring)."""

    top_k: int = 8  # children per expanded node, and frontier width
    depth: int = 6  # deepest draft level (expansions = depth - 1)
    total_tokens: int = 48  # draft tokens kept, root excluded

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DynamicTreeConfig.{name} must be a positive int, got {v!r}")
        if self.total_tokens > self.max_candidates:
            raise ValueError(
                f"DynamicTreeConfig.total_tokens={self.total_tokens} exceeds the "
                f"{self.max_candidates} candidates that top_k={self.top_k}, depth={self.depth} "
                f"produce (top_k + (depth - 1) * top_k**2); lower total_tokens or raise top_k/depth"
            )

    @property
    def max_candidates(self) -> int:
        """Draft candidates after all expansions (root excluded)."""
        return self.top_k + (self.depth - 1) * self.top_k**2


@dataclass
class Frontier:
    """The nodes the drafter feeds next (F = top_k of them, all at one depth)."""

    # [F] long, candidate slot of each frontier node
    indices: torch.Tensor
    # [F] long, token of each frontier node
    tokens: torch.Tensor
    # [F] long, row of the previous feed whose output is each node's parent
    # (0 at depth 1: the root's logits); pick the parents' hidden states with it
    parent_rows: torch.Tensor
    # [F, F * d] bool, node f may attend to entry j of all frontiers fed so far,
    # this one included, concatenated in feeding order (= its ancestors and itself)
    mask: torch.Tensor
    # depth of every frontier node (d)
    depth: int


@dataclass
class DynamicTree:
    """The finished tree and where its nodes came from."""

    tree: Tree
    # [N] long, candidate slot of each tree node (kept[0] = 0, the root)
    kept: torch.Tensor
    # [N] float, cumulative log-prob of each node (root 0)
    scores: torch.Tensor


class DynamicTreeBuilder:
    """Bookkeeping of one EAGLE-2 draft step; ``start`` resets it for reuse.

    Public buffers (``[M]`` = 1 + ``config.max_candidates`` slots; slots at or
    past ``num_candidates`` are padding): ``tokens``, ``parents`` (slot of the
    parent, -1 for the root), ``scores`` (cumulative log-prob), ``depth``.
    """

    def __init__(self, config: DynamicTreeConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        m = 1 + config.max_candidates
        # [M] long
        self.tokens = torch.full((m,), PAD_ID, dtype=torch.long, device=device)
        # [M] long
        self.parents = torch.full((m,), -1, dtype=torch.long, device=device)
        # [M] float
        self.scores = torch.full((m,), float("-inf"), device=device)
        # [M] long
        self.depth = torch.zeros(m, dtype=torch.long, device=device)
        # [M] float, ranking key = min(score, parent key); see the module docstring
        self._key = torch.full((m,), float("-inf"), device=device)
        # [M, M] bool, _anc[i, j] = slot j is slot i or one of its ancestors
        self._anc = torch.zeros(m, m, dtype=torch.bool, device=device)
        self.num_candidates = 0
        self._frontiers: list[torch.Tensor] = []

    def ancestor_mask(self, indices: torch.Tensor) -> torch.Tensor:
        """[F, M] bool ancestor-or-self rows of the candidate slots ``indices`` [F]."""
        return self._anc[indices]

    def start(self, root_token: torch.Tensor | int, logp: torch.Tensor, tokens: torch.Tensor) -> Frontier:
        """Reset, and add the root's top-k children (the first frontier).

        Args:
            root_token: the root's token (int or 0-d long tensor).
            logp: [top_k] float, log-prob of each child of the root.
            tokens: [top_k] long, token of each child of the root.
        """
        k = self.config.top_k
        if logp.shape != (k,) or tokens.shape != (k,):
            raise ValueError(
                f"start expects logp and tokens of shape [top_k] = [{k}], "
                f"got {tuple(logp.shape)} and {tuple(tokens.shape)}"
            )
        self.tokens.fill_(PAD_ID)
        self.parents.fill_(-1)
        self.scores.fill_(float("-inf"))
        self._key.fill_(float("-inf"))
        self.depth.zero_()
        self._anc.zero_()
        self.tokens[0] = root_token
        self.scores[0] = 0.0
        self._key[0] = float("inf")  # so min(score, parent key) = score at depth 1
        self._anc[0, 0] = True
        self.num_candidates = 1
        self._frontiers = []
        slots = self._add(self.tokens.new_zeros(k), logp, tokens)
        return self._set_frontier(slots, torch.zeros_like(slots))

    def expand(self, logp: torch.Tensor, tokens: torch.Tensor) -> Frontier:
        """Add the top-k children of every frontier node; pick the next frontier.

        Args:
            logp: [F, top_k] float, log-prob of child j of frontier node f
                (rows in the order of the current ``Frontier.indices``).
            tokens: [F, top_k] long, token of that child.

        Returns:
            The top_k children with the best cumulative scores (ties: lower slot).
        """
        k = self.config.top_k
        if not self._frontiers:
            raise RuntimeError("call start() before expand()")
        if len(self._frontiers) >= self.config.depth:
            raise RuntimeError(f"already expanded to depth {self.config.depth}; call finish()")
        if logp.shape != (k, k) or tokens.shape != (k, k):
            raise ValueError(
                f"expand expects logp and tokens of shape [F, top_k] = [{k}, {k}], "
                f"got {tuple(logp.shape)} and {tuple(tokens.shape)}"
            )
        parents = self._frontiers[-1].repeat_interleave(k)
        slots = self._add(parents, logp.reshape(-1), tokens.reshape(-1))
        best = torch.sort(self._key[slots], descending=True, stable=True).indices[:k]
        return self._set_frontier(slots[best], best // k)

    def finish(self, total_tokens: int | None = None) -> DynamicTree:
        """Keep the root and the ``total_tokens`` best candidates, as a ``Tree``.

        Nodes are ordered by depth, then by ranking key (= score for
        log-probs; best first), then by slot.

        Args:
            total_tokens: draft tokens to keep (root excluded); default
                ``config.total_tokens``. At most the candidates added so far.
        """
        total = self.config.total_tokens if total_tokens is None else total_tokens
        available = self.num_candidates - 1
        if not 1 <= total <= available:
            raise ValueError(f"total_tokens must be in [1, {available}] (candidates so far), got {total}")
        key = self._key[1 : self.num_candidates]
        ranked = torch.sort(key, descending=True, stable=True).indices[:total] + 1
        ranked = ranked[torch.sort(self.depth[ranked], stable=True).indices]
        kept = torch.cat([ranked.new_zeros(1), ranked])
        node_of = torch.full_like(self.parents, -1)
        node_of[kept] = torch.arange(kept.shape[0], device=kept.device)
        parent_slots = self.parents[kept]
        parents = torch.where(parent_slots >= 0, node_of[parent_slots.clamp(min=0)], -1)
        tree = Tree(
            tokens=self.tokens[kept],
            parents=parents,
            depth=self.depth[kept],
            mask=self._anc[kept][:, kept],
        )
        return DynamicTree(tree=tree, kept=kept, scores=self.scores[kept])

    def _add(self, parents: torch.Tensor, logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Append candidates; parents, logp, tokens are [C]. Returns their slots [C]."""
        c = parents.shape[0]
        start = self.num_candidates
        slots = torch.arange(start, start + c, device=self.tokens.device)
        logp = logp.to(self.scores.dtype)
        self.tokens[slots] = tokens.long()
        self.parents[slots] = parents
        self.scores[slots] = self.scores[parents] + logp
        self._key[slots] = torch.minimum(self.scores[slots], self._key[parents])
        self.depth[slots] = self.depth[parents] + 1
        self._anc[slots] = self._anc[parents]
        self._anc[slots, slots] = True
        self.num_candidates = start + c
        return slots

    def _set_frontier(self, slots: torch.Tensor, parent_rows: torch.Tensor) -> Frontier:
        self._frontiers.append(slots)
        fed = torch.cat(self._frontiers)
        return Frontier(
            indices=slots,
            tokens=self.tokens[slots],
            parent_rows=parent_rows,
            mask=self._anc[slots][:, fed],
            depth=len(self._frontiers),
        )
