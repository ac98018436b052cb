"""The target-model contract every backend (native, transformers) implements.

A target runs a forward over T new tokens with explicit positions and an
explicit attention mask on top of a cached prefix, writing their keys/values at
cache slots ``start .. start + T``, and can commit an accepted tree path into
place. Models know nothing about speculation beyond that.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from eyas.models.config import ModelConfig


@dataclass
class ForwardOutput:
    # [B, T, V] (or [B, len(logits_idx), V] when only some rows were asked for); with ForwardMeta.argmax_only
    # possibly -inf except where an entry can be its row's maximum
    logits: torch.Tensor
    # [B, T, D] final feature after the last norm (what EAGLE-1 drafts from)
    hidden: torch.Tensor
    # layer index -> [B, T, D] residual stream entering that layer (EAGLE-3 taps)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    # [B, T] long, logits.argmax(-1), where the forward found it on the way (the output screen); None: read it from
    # the logits
    greedy: torch.Tensor | None = None


@dataclass
class PathAttention:
    """Batch-invariant tree attention for exact mode (batch of one).

    In a tree forward an accepted node's ancestors sit among their siblings' slots (masked for
    it), while plain decoding computes the same token with its ancestors in consecutive slots and
    nothing after them. Masked keys still enter the fused attention kernel's arithmetic, so in
    bf16 the two layouts round differently and greedy outputs drift (measured: bit-level logit
    differences, diverging outputs after 70-90 tokens). With a ``PathAttention`` every query row r reads its own copy of
    the cache, ``mirror`` row r: the committed prefix followed by r's root-to-node path in
    consecutive slots ``start, start + 1, ...``, the layout plain decoding uses. Each (row, KV head)
    is one small GEMM of fixed shape over a key length that is a multiple of 64, so a node's
    attention rounds exactly as when plain decoding (one row, the cache as its own mirror)
    computes that token, however many rows share the forward (eyas.models.attention). Slots past
    a row's path are written as zeros (masked either way).
    """

    # [N, N] long: row r's path (tree-node indices, root first, r last), then filler (masked)
    order: torch.Tensor
    # [N] long: path lengths
    lengths: torch.Tensor
    # committed slots before the tree
    start: int
    # keys every row's attention spans (S, a multiple of KV_BLOCK): ``masks``' width
    kv_len: int
    # a KV cache with W >= N rows, prefix kept equal to the real cache's (see SpecDecoder);
    # None for a one-node tree (a plain step): the sequence's own cache row is its mirror; and with ``kernel``
    mirror: object | None
    # the compiled kernel (eyas.kernels.path_attention): every node reads the shared cache, prefix then its path's
    # slots, in one fixed order, with no mirror
    kernel: object | None = None

    @classmethod
    def from_tree_mask(cls, tree_mask: torch.Tensor, start: int, kv_len: int, mirror, kernel=None) -> PathAttention:
        """tree_mask: [N, N] bool ancestor-or-self, nodes topologically ordered; mirror rows >= N.

        ``mirror`` None: a one-node tree (a plain step in exact mode) attends its own cache row, and with
        ``kernel`` a tree of any size attends the shared cache.
        """
        n, dev = tree_mask.shape[0], tree_mask.device
        rows = n if kernel is not None else 1 if mirror is None else int(mirror.k.shape[1])
        if rows < n:
            raise ValueError(f"path attention: {n} tree nodes but a mirror of {rows} rows")
        if kernel is not None and dev.type == "cpu":  # a handful of nodes: on host lists, three tensors out
            anc = tree_mask.tolist()
            order = [[j for j in range(n) if row[j]] + [j for j in range(n) if not row[j]] for row in anc]
            pa = cls(order=torch.tensor(order), lengths=torch.tensor([sum(row) for row in anc]), start=start,
                     kv_len=kv_len, mirror=mirror, kernel=kernel)
            pa.__dict__["slots"] = torch.tensor([[start + j for j in row] for row in order])  # the cached property
            return pa
        cols = torch.arange(n, device=dev).expand(n, n)
        order = torch.where(tree_mask, cols, cols + n).argsort(dim=1)  # path nodes first, ascending
        return cls(order=order, lengths=tree_mask.sum(1), start=start, kv_len=kv_len, mirror=mirror, kernel=kernel)

    # derived once per forward (every layer reads them)
    @functools.cached_property
    def keep(self) -> torch.Tensor:
        """[N, N] bool: slot j of row r's block holds a path node (the rest is zeroed)."""
        return torch.arange(self.order.shape[1], device=self.order.device)[None] < self.lengths[:, None]

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """[N, N] long: row r's path as cache slots (the tree's entries sit at start + node index)."""
        return self.order + self.start

    @functools.cached_property
    def masks(self) -> torch.Tensor:
        """[N, 1, 1, S] bool: row r attends slots < start + len(path r)."""
        pos = torch.arange(self.kv_len, device=self.lengths.device)
        return (pos[None] < (self.start + self.lengths)[:, None])[:, None, None]

    @functools.cached_property
    def hidden(self) -> torch.Tensor:
        """[N, 1, 1, S] bool: ~masks, the slots a row may not attend."""
        return ~self.masks

    @property
    def paths(self) -> list[list[int]]:
        """Each real row's path as host lists (tests, debugging)."""
        return [row[:k].tolist() for row, k in zip(self.order, self.lengths.tolist(), strict=True) if k]


@dataclass
class ForwardMeta:
    """Everything one target forward needs besides its tokens, positions and cache.

    Example (a 3-node tree after 40 cached slots, batch of one, fast mode):
    ``ForwardMeta(start=40, mask=m)`` with m [1, 3, 43] bool: the prefix, then each node's ancestors.
    """

    # cached slots before the new tokens: an int, or [B] long (one committed length per row; native backend)
    start: int | torch.Tensor
    # [B, T, S] bool, True = may attend; S = kv_len or start + T; None = causal
    mask: torch.Tensor | None = None
    # exact mode: one PathAttention per batch row instead of ``mask`` (native backend)
    paths: list[PathAttention] | None = None
    # keys attended (sizes the mask); None = start + T
    kv_len: int | None = None
    # [B] long, one-token decode only: row b attends slots 0 .. row_lengths[b] - 1 (what ``mask`` says too); a
    # backend may attend each row over its own length instead of reading every row up to kv_len under the mask
    row_lengths: torch.Tensor | None = None
    # [R] long rows of T to compute logits for; None = all
    logits_idx: torch.Tensor | None = None
    # layer indices whose input residual stream to return (EAGLE-3 taps)
    taps: tuple[int, ...] = ()
    # exact mode outside path attention (prefill chunks): linears padded to their row floors (eyas.models.exact)
    exact: bool = False
    # the caller reads only each row's argmax (greedy decoding): a backend may return logits that are exact where
    # they can be the maximum and -inf elsewhere (eyas.models.lm_screen); argmax then equals the full logits'
    argmax_only: bool = False
    # a fresh pass from slot 0 with no mask (training features): SDPA's own is_causal instead of an explicit
    # [B, 1, T, T] mask, which on a GPU rules out its flash kernels (native backend; others build the mask)
    causal: bool = False


class TargetModel(ABC):
    """A causal LM that eyas can speculate on: ``run`` a forward described by a ``ForwardMeta``.

    A backend that cannot honour part of a meta (per-row starts, path attention) refuses it with a
    ValueError naming the backend that can; ``row_starts`` and ``path_attention`` say so up front.
    """

    config: ModelConfig
    # ForwardMeta.start may be a [B] tensor (sequences of different lengths in one forward, eyas.batch)
    row_starts: bool = False
    # ForwardMeta.paths is supported (exact mode for trees)
    path_attention: bool = False

    def path_kernel(self):
        """Exact mode's compiled tree attention for this target (eyas.kernels), or None: then a tree's
        path attention needs a mirror (a per-node copy of the cache).
        """
        return None

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def new_cache(self, batch: int, max_slots: int):
        """Allocate a cache holding ``max_slots`` positions for ``batch`` rows."""

    @abstractmethod
    def run(
        self,
        # [B, T] long
        tokens: torch.Tensor,
        # [B, T] long, absolute positions (RoPE)
        positions: torch.Tensor,
        cache,
        meta: ForwardMeta,
    ) -> ForwardOutput:
        """Run T new tokens after ``meta.start`` cached slots."""

    def forward(self, tokens, positions, cache, start, mask=None, taps=(), logits_idx=None, kv_len=None,
                paths=None, causal=False) -> ForwardOutput:
        """Keyword form of ``run`` (scripts, tests): the fields of ``ForwardMeta`` as arguments."""
        if isinstance(paths, PathAttention):
            paths = [paths]
        meta = ForwardMeta(start=start, mask=mask, paths=paths, kv_len=kv_len, logits_idx=logits_idx, taps=taps,
                           causal=causal)
        return self.run(tokens, positions, cache, meta)

    @abstractmethod
    def commit(self, cache, start: int, src: torch.Tensor) -> None:
        """Move accepted entries ``start + src[j]`` to ``start + j``; src: [A] long."""

    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] long -> [B, T, D] input embeddings."""

    @abstractmethod
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] final features -> [..., V] logits."""


def causal_mask(t: int, start: int, kv_len: int | None = None, device=None) -> torch.Tensor:
    """[T, S] bool mask for a chain of T tokens after ``start`` cached slots.

    Row i may attend slots 0 .. start + i. S = kv_len (>= start + T) or start + T.
    """
    s = kv_len if kv_len is not None else start + t
    rows = torch.arange(t, device=device)[:, None] + start
    return torch.arange(s, device=device)[None, :] <= rows
