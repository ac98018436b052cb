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

import functools
from dataclasses import dataclass

import torch

from eyas.tree.build import bit_mask, tree_from_lists
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


class Frontier:
    """The nodes the drafter feeds next (F = top_k of them, all at one depth).

    Built from the builder's lists; each tensor is made on first use (the frontier past the last feed is
    never fed, and a drafter reads only what its attention needs).
    """

    def __init__(self, slots: list[int], tokens: list[int], parent_rows: list[int], ancestors: list[int],
                 fed: list[int], depth: int, device: torch.device) -> None:
        self.slots, self.token_list, self.parent_row_list = slots, tokens, parent_rows
        # ancestors[f]: node f's ancestor-or-self bit set over candidate slots; fed: the slots of all frontiers fed
        # so far, this one included, in feeding order
        self.ancestors, self.fed = ancestors, fed
        self.depth = depth  # depth of every frontier node (d)
        self.device = device

    @functools.cached_property
    def seen(self) -> list[list[int]]:
        """seen[f]: the fed entries node f attends, ascending (its ancestors, then itself): what the compiled head
        layer reads (eyas.drafters.head_kernels.HeadPaths); ``mask`` as lists.
        """
        return [[j for j, c in enumerate(self.fed) if (bits >> c) & 1] for bits in self.ancestors]

    @functools.cached_property
    def indices(self) -> torch.Tensor:
        """[F] long, candidate slot of each frontier node."""
        return torch.tensor(self.slots, dtype=torch.long, device=self.device)

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        """[F] long, token of each frontier node."""
        return torch.tensor(self.token_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def parent_rows(self) -> torch.Tensor:
        """[F] long, row of the previous feed whose output is each node's parent (0 at depth 1: the root's
        logits); pick the parents' hidden states with it.
        """
        return torch.tensor(self.parent_row_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[F, F * d] bool: node f may attend fed entry j (``seen`` as a tensor)."""
        return bit_mask(self.ancestors, self.fed, self.device)


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

    The books are a few dozen candidates, so they live in Python lists (a torch op on a tensor of ten
    elements costs microseconds of dispatch, a list operation tens of nanoseconds: 0.29 -> 0.1 ms a
    draft step for ``dynamic:2,2,3``); tensors are made only for what leaves the builder (frontiers, the
    tree). Ancestor sets are bit masks: bit j of ``_anc[i]`` = slot j is slot i or one of its ancestors.

    Public buffers, as tensors of ``[M]`` = 1 + ``config.max_candidates`` slots (slots at or past
    ``num_candidates`` are padding): ``tokens``, ``parents`` (slot of the parent, -1 for the root),
    ``scores`` (cumulative log-prob), ``depth``.
    """

    def __init__(self, config: DynamicTreeConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._slots = 1 + config.max_candidates
        self._reset()

    def _reset(self) -> None:
        self._tok: list[int] = []
        self._par: list[int] = []
        self._score: list[float] = []
        self._key: list[float] = []  # ranking key = min(score, parent key); see the module docstring
        self._depth: list[int] = []
        self._anc: list[int] = []
        self._frontiers: list[list[int]] = []
        self._fed: list[int] = []  # slots of all frontiers so far, in feeding order

    @property
    def num_candidates(self) -> int:
        """Slots filled so far, the root included."""
        return len(self._tok)

    def _padded(self, values: list, pad, dtype) -> torch.Tensor:
        return torch.tensor(values + [pad] * (self._slots - len(values)), dtype=dtype, device=self.device)

    @property
    def tokens(self) -> torch.Tensor:
        return self._padded(self._tok, PAD_ID, torch.long)

    @property
    def parents(self) -> torch.Tensor:
        return self._padded(self._par, -1, torch.long)

    @property
    def scores(self) -> torch.Tensor:
        return self._padded(self._score, float("-inf"), torch.float32)

    @property
    def depth(self) -> torch.Tensor:
        return self._padded(self._depth, 0, torch.long)

    def candidates(self) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, scores) of the candidates so far, as lists (slot order)."""
        return list(self._tok), list(self._par), list(self._score)

    def ancestor_mask(self, indices: torch.Tensor) -> torch.Tensor:
        """[F, M] bool ancestor-or-self rows of the candidate slots ``indices`` [F]."""
        return self._mask(indices.tolist(), range(self._slots))

    def _mask(self, slots: list[int], cols) -> torch.Tensor:
        """[len(slots), len(cols)] bool ancestor-or-self rows of ``slots`` over the slots ``cols``."""
        return bit_mask([self._anc[i] for i in slots], cols, self.device)

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
        self._reset()
        self._tok.append(int(root_token))
        self._par.append(-1)
        self._score.append(0.0)
        self._key.append(float("inf"))  # so min(score, parent key) = score at depth 1
        self._depth.append(0)
        self._anc.append(1)
        slots = self._add([0] * k, logp.tolist(), tokens.tolist())
        return self._set_frontier(slots, [0] * k)

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
        parents = [p for p in self._frontiers[-1] for _ in range(k)]
        slots = self._add(parents, logp.reshape(-1).tolist(), tokens.reshape(-1).tolist())
        key = self._key
        best = sorted(range(len(slots)), key=lambda j: (-key[slots[j]], j))[:k]
        return self._set_frontier([slots[j] for j in best], [j // k for j in best])

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
        depth = self._depth
        kept = [0, *sorted(self.ranking()[:total], key=lambda i: depth[i])]  # stable: key order within a depth
        node_of = {slot: n for n, slot in enumerate(kept)}
        dev = self.device
        tree = tree_from_lists([self._tok[i] for i in kept], [node_of[self._par[i]] if i else -1 for i in kept], dev)
        kept_t = torch.tensor(kept, dtype=torch.long, device=dev)
        scores = torch.tensor([self._score[i] for i in kept], dtype=torch.float32, device=dev)
        return DynamicTree(tree=tree, kept=kept_t, scores=scores)

    def ranking(self) -> list[int]:
        """Candidate slots (root excluded), best first: by ranking key, ties to the lower slot. ``finish`` keeps a
        prefix of it; a parent always precedes its children (module docstring).
        """
        key = self._key
        return sorted(range(1, self.num_candidates), key=lambda i: (-key[i], i))

    def keys(self, slots: list[int]) -> list[float]:
        """Ranking keys of candidate slots (log path probabilities for log-prob scores)."""
        return [self._key[i] for i in slots]

    def _add(self, parents: list[int], logp: list[float], tokens: list[int]) -> list[int]:
        """Append candidates (parallel lists); returns their slots."""
        start = self.num_candidates
        for p, lp, t in zip(parents, logp, tokens, strict=True):
            slot = len(self._tok)
            score = self._score[p] + lp
            self._tok.append(t)
            self._par.append(p)
            self._score.append(score)
            self._key.append(min(score, self._key[p]))
            self._depth.append(self._depth[p] + 1)
            self._anc.append(self._anc[p] | (1 << slot))
        return list(range(start, self.num_candidates))

    def _set_frontier(self, slots: list[int], parent_rows: list[int]) -> Frontier:
        self._frontiers.append(slots)
        self._fed += slots
        return Frontier(slots, [self._tok[i] for i in slots], parent_rows, [self._anc[i] for i in slots],
                        list(self._fed), len(self._frontiers), self.device)
