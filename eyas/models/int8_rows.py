"""A draft head's projections as per-row int8 weights, multiplied in int8 on a CPU with AVX512-VNNI.

``eyas/kernels/head_i8.cpp`` quantises each input row to int8 with its own scale and sums bytes with VPDPBUSD (64
multiply-adds an instruction, no float weight rebuilt): a float32 head's tree level costs about half the Q8_0 float
kernel's (docs/benchmarks.md). Only a drafter's head uses it: the draft changes by the rounding, verification keeps
the output lossless. ``Int8Rows`` has ``GGUFBlocks``'s ``linear``/``cat`` protocol, so the head's modules
(eyas.models.packed, eyas.drafters.head_kernels) call either without knowing which.

Where it serves (``int8_head_ready``): the kernel built and the CPU has AVX512-VNNI, ``EYAS_HEAD_INT8`` not 0, and a
float32 head (``EYAS_HEAD_INT8=1`` also takes a bf16 head: not yet measured on an AVX512-BF16 CPU, so not the
default there). The kernel prefetches weight groups ahead of its multiply-adds (``EYAS_HEAD_I8_PREFETCH``: groups
ahead, 0 off, default 2; read when a head is quantised, so ``scripts/head_ab.py --later-env`` can compare).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eyas import kernels

_kernel = kernels.Lazy(kernels.head_i8, usable=lambda k: k.available())
_EMPTY = torch.empty(0)


@dataclass
class Int8Rows:
    """One projection's weight [N, K]: ``data`` int8, ``scale`` [N] float32 (w ~ data * scale), ``sums`` [N] int32."""

    data: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor
    k: int

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Rows:
        """w: [N, K] -> each row rounded to int8 with scale max |row| / 127 (an all-zero row: scale 0)."""
        w = w.detach().float()
        amax = w.abs().amax(dim=1)
        scale = amax / 127
        inv = torch.where(amax > 0, 127 / amax.clamp(min=1e-30), torch.zeros(()))
        q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(data=q.contiguous(), scale=scale, sums=q.sum(dim=1, dtype=torch.int32), k=w.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weights the kernel multiplies with (what the torch path uses beside it)."""
        return self.data.float() * self.scale[:, None]

    @classmethod
    def cat(cls, parts: list[Int8Rows]) -> Int8Rows:
        """Several projections over the same input as one (rows in order): one kernel call."""
        return cls(data=torch.cat([p.data for p in parts]), scale=torch.cat([p.scale for p in parts]),
                   sums=torch.cat([p.sums for p in parts]), k=parts[0].k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [..., K] float32 or bf16 -> [..., N] in x's dtype (bias float32 or None)."""
        b = _EMPTY if bias is None else bias.float()
        out = _kernel().linear(x.reshape(-1, self.k), self.data, self.scale, self.sums, b)
        return out.view(*x.shape[:-1], out.shape[1])


def int8_head_ready(dtype: torch.dtype) -> bool:
    """Whether a head of ``dtype`` on a CPU gets int8 projections (see the module docstring)."""
    mode = os.environ.get("EYAS_HEAD_INT8", "auto")
    if mode == "0" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and mode != "1":
        return False
    return _kernel() is not None


def set_prefetch_from_env() -> int:
    """Apply ``EYAS_HEAD_I8_PREFETCH`` (weight groups ahead, 0 off; default 2) to the kernel; returns it."""
    raw = os.environ.get("EYAS_HEAD_I8_PREFETCH", "2")
    if not raw.isdigit() or int(raw) > 64:
        raise ValueError(f"EYAS_HEAD_I8_PREFETCH={raw!r}: weight groups to prefetch ahead, 0 (off) to 64")
    _kernel().set_prefetch(int(raw))
    return int(raw)


def int8_serves(w: torch.Tensor) -> bool:
    """A weight the kernel takes (``int8_head_ready`` first): [N, K] with K a multiple of its chunk (64 bytes), on a
    CPU.
    """
    return w.dim() == 2 and w.device.type == "cpu" and w.shape[1] % _kernel().chunk() == 0
