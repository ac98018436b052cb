"""Preallocated KV cache indexed by slot (gpt-fast style).

Every forward writes its new keys/values at slots ``start .. start + T`` and
attends over slots ``0 .. start + T`` through an explicit mask, so nothing is
ever rolled back: slots past the committed prefix are simply overwritten by the
next forward. Committing an accepted tree path moves the accepted nodes' entries
into contiguous slots right after the prefix (``commit``), with no recomputation.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

# CPU caches at least this large take their memory from an anonymous mmap (see lazy_zeros)
LAZY_BYTES = 32 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, but on a CPU a large tensor's pages are zeroed by the kernel on first touch.

    A cache is sized for the prompt plus every token it may generate, and zero-filling it up front
    stalls whoever waits for the allocation: measured on the 2-core VM, 0.7 s for the 544 MB
    exact-mode mirror of a 7,800-token prompt, inside one serving step. An anonymous mmap is zero by the
    kernel's guarantee and costs its pages only as the sequence reaches them.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass
class KVCache:
    """Keys and values of all layers."""

    # [Lyr, B, Hk, S, Dh]
    k: torch.Tensor
    # [Lyr, B, Hk, S, Dh]
    v: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_slots: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (num_layers, batch, num_kv_heads, max_slots, head_dim)
        return cls(lazy_zeros(shape, dtype, device), lazy_zeros(shape, dtype, device))

    @property
    def max_slots(self) -> int:
        return int(self.k.shape[3])

    def update(
        self, layer: int, start: int | torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new entries and return the keys/values to attend over.

        k_new, v_new: [B, Hk, T, Dh] written at slots start .. start + T, where ``start``
        is one int for every row or a [B] long tensor, one offset per row (batched serving:
        each sequence has its own committed length).
        Returns k, v views [B, Hk, kv_len, Dh].
        """
        t = k_new.shape[2]
        top = start + t if isinstance(start, int) else int(start.max()) + t
        if top > self.max_slots:
            raise ValueError(
                f"KV cache overflow: writing slots up to {top} into a cache of "
                f"{self.max_slots} slots; raise max_slots (prompt + max_new_tokens + tree size)"
            )
        if isinstance(start, int):
            self.k[layer, :, :, start : start + t] = k_new
            self.v[layer, :, :, start : start + t] = v_new
        else:
            rows = torch.arange(k_new.shape[0], device=start.device)[:, None]  # [B, 1]
            slots = start[:, None] + torch.arange(t, device=start.device)  # [B, T]
            # advanced indices around a slice put [B, T] first: [B, T, Hk, Dh]
            # index_put needs matching dtypes (a bf16 model keeps an fp32 cache on CPU)
            self.k[layer][rows, :, slots] = k_new.transpose(1, 2).to(self.k.dtype)
            self.v[layer][rows, :, slots] = v_new.transpose(1, 2).to(self.v.dtype)
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def rows(self, lo: int, hi: int) -> KVCache:
        """A view of batch rows lo .. hi (writes go to this cache)."""
        return KVCache(self.k[:, lo:hi], self.v[:, lo:hi])

    def copy_row(self, src: int, dst: int, slots: int) -> None:
        """Copy the first ``slots`` entries of row ``src`` into row ``dst`` (batch compaction)."""
        self.k[:, dst, :, :slots] = self.k[:, src, :, :slots]
        self.v[:, dst, :, :slots] = self.v[:, src, :, :slots]

    def commit(self, start: int, src: torch.Tensor) -> None:
        """Move the entries of accepted nodes into place after the prefix.

        src: [A] long, offsets (relative to ``start``) of the accepted nodes, in
        path order; entry ``start + src[j]`` moves to slot ``start + j``.
        Example: a tree written at slots 10..17 whose accepted path is nodes
        [0, 2, 5] -> slots 10, 12, 15 move to 10, 11, 12.
        """
        a = src.shape[0]
        if src.device.type == "cpu" and src.tolist() == list(range(a)):
            return  # the accepted nodes are the first A, in order (a rejected draft, the first child kept): in place
        idx = src.to(self.k.device) + start
        # gather first, then write, so overlapping source/target slots are safe
        self.k[:, :, :, start : start + a] = self.k.index_select(3, idx)
        self.v[:, :, :, start : start + a] = self.v.index_select(3, idx)

    def broadcast_from(self, src: KVCache, lo: int, hi: int) -> None:
        """Copy slots lo .. hi of ``src``'s row 0 into every row of this cache (exact mode's mirror)."""
        self.k[:, :, :, lo:hi] = src.k[:, :1, :, lo:hi]
        self.v[:, :, :, lo:hi] = src.v[:, :1, :, lo:hi]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class RowCaches:
    """Independent 1-row caches, one per batch row, seen by a batched forward as one batch.

    Batched exact mode attends row by row anyway (``PathAttention``), so rows need not share one
    [B, S] buffer: each keeps the cache its prefill filled, sized to its own budget. A long prompt
    joining then costs only its own memory, never a copy of every row grown to its length.
    """

    caches: list[KVCache]

    @property
    def max_slots(self) -> int:
        return max(c.max_slots for c in self.caches)

    def rows(self, lo: int, hi: int) -> KVCache:
        if hi != lo + 1:
            raise ValueError(f"RowCaches holds independent rows: ask for one row at a time, not {lo}..{hi}")
        return self.caches[lo]
