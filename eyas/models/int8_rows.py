"""A draft head's projections as per-row int8 weights, multiplied in int8 on a CPU with AVX512-VNNI or AVX2.

``eyas/kernels/head_i8.cpp`` quantises each input row to int8 with its own scale and sums bytes with VPDPBUSD (64
multiply-adds an instruction, no float weight rebuilt): a float32 head's tree level costs about half the Q8_0 float
kernel's (docs/benchmarks.md). On AVX2 alone (``head_i8_avx2.h``) the same sums, bit for bit, through VPMADDUBSW,
each weight row read as one stream: on the Zen 3 VM (float32) the head's five projections took 0.6-0.8x the Q8_0
kernel's time at 1-6 rows with their weights cold, and decoding ran 1.011x and 1.035x as fast (two one-process A/Bs,
24 tuning questions, the same tau). Only a drafter's head uses it: the draft changes by the rounding, verification keeps
the output lossless. ``Int8Rows`` has ``GGUFBlocks``'s ``linear``/``cat`` protocol, so the head's modules
(eyas.models.packed, eyas.drafters.head_kernels) call either without knowing which.

Where it serves (``int8_head_ready``): the kernel built (a CPU with AVX2), ``EYAS_HEAD_INT8`` not 0, and a
float32 head, or a bf16 head where the int8 projections measured much cheaper than the bf16 Q8_0 kernel's on this
machine (``bf16_int8_pays``: timed once, cached; ``EYAS_HEAD_INT8=1`` takes a bf16 head anyway). On a Zen 4 VM a
bf16 head decoded 0.99x and 1.03x as fast with int8 as with Q8_0 (two one-process A/Bs); on an Intel Xeon (family 6
model 207) its int8 projections took 0.37-0.43x the Q8_0 time at 1-4 rows and decoding ran 1.05-1.06x
(docs/benchmarks.md). On AVX512-VNNI the kernel reads each group of 4 weight rows as one stream (``tiles_in_use``,
``EYAS_HEAD_I8_TILES=0`` keeps plain rows); the AVX2 body reads plain rows and prefetches weight groups ahead of its
multiply-adds (``EYAS_HEAD_I8_PREFETCH``: groups ahead, 0 off; default 2 for rows, 0 for tiles, which the hardware
prefetcher follows better alone). Both are read when a head is quantised, so ``scripts/head_ab.py --later-env`` can
compare them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas import kernels
from eyas.models.machine_cache import best_alternating, cached_json, machine_key
from eyas.notes import one_time_note

_kernel = kernels.Lazy(kernels.head_i8, usable=lambda k: k.available())
_EMPTY = torch.empty(0)


@dataclass
class Int8Rows:
    """One projection's weight [N, K]: ``data`` int8, ``scale`` [N] float32 (w ~ data * scale), ``sums`` [N] int32."""

    data: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor
    k: int
    # whether the kernel reads data tiled (``tiles_in_use``), decided when the rows are made, as the prefetch distance
    # is; and data in that layout, made at the first ``linear`` (only the projections that run pay its memory)
    tiled: bool = field(default_factory=lambda: tiles_in_use(), repr=False, compare=False)
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)

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
        out = _kernel().linear(x.reshape(-1, self.k), *self.kernel_weights(), b)
        return out.view(*x.shape[:-1], out.shape[1])

    def kernel_weights(self) -> tuple[torch.Tensor, bool, torch.Tensor, torch.Tensor]:
        """(data in the kernel's layout, tiled, scale, sums): what ``linear`` hands the kernel (and
        eyas.drafters.head_step its compiled call); the tiled copy is made on first use.
        """
        if self.packed is None:
            self.packed = _kernel().pack(self.data) if self.tiled else self.data.contiguous()
        return self.packed, self.tiled, self.scale, self.sums


def tiles_in_use() -> bool:
    """Whether new ``Int8Rows`` are tiled: the kernel's build reads tiles (AVX512-VNNI) and ``EYAS_HEAD_I8_TILES`` is
    not 0.

    Tiled (the kernel's ``pack``), a group of 4 weight rows is one stream of memory (each 64-byte chunk of the 4 rows in
    turn) instead of 4 interleaved ones, which the hardware prefetcher follows: on the Zen 4 VM the embedded head's five
    projections at 1 / 3 rows took 0.414 / 0.528 ms from DRAM and 0.222 / 0.201 from the caches, against 0.583 / 0.819
    and 0.419 / 0.254 as rows (``scripts/head_cold.py --dtype bfloat16 --layouts``). The sums are the same.
    """
    kernel = _kernel()
    return os.environ.get("EYAS_HEAD_I8_TILES", "1") != "0" and kernel is not None and kernel.tiles()


def int8_head_ready(dtype: torch.dtype) -> bool:
    """Whether a head of ``dtype`` on a CPU gets int8 projections (see the module docstring)."""
    mode = os.environ.get("EYAS_HEAD_INT8", "auto")
    if mode == "0" or dtype not in (torch.float32, torch.bfloat16) or _kernel() is None:
        return False
    if dtype == torch.bfloat16 and mode != "1":
        return bf16_int8_pays()
    return True


# A bf16 head goes int8 where its projections then take at most this share of the Q8_0 kernel's time: int8 also
# rounds the draft's activations (tau 0.4-0.9 % lower in the A/Bs above), so a small saving does not pay.
PAYS = 0.7
# the projections timed: the embedded default's EAGLE-3 head (fused q|k|v, o, fused gate|up, down, lm_head)
HEAD_SHAPES = ((960, 1152), (576, 576), (4608, 576), (576, 2304), (8192, 576))
HEAD_ROWS = (1, 2, 3)  # a head's calls: the root and few-token extensions, top-2 tree levels


@functools.cache
def bf16_int8_pays() -> bool:
    """Whether a bf16 head's projections run on the int8 kernel on this machine: timed against the bf16 Q8_0 block
    kernel once (~1 s), then read from ``$EYAS_CACHE/head_int8/`` (keyed by CPU, threads and the kernels' sources).
    False where either kernel is missing.
    """
    q8 = kernels.gguf_bf16() if os.environ.get("EYAS_GGUF_BLOCKS", "1") != "0" else None
    if _kernel() is None or q8 is None or not q8.available():
        return False

    def measure() -> dict:
        one_time_note("timing the draft head's int8 projections against its Q8_0 ones on this CPU", "~1 s")
        q8_s, i8_s = time_head_kernels(q8)
        return {"q8_ms": round(1e3 * q8_s, 4), "int8_ms": round(1e3 * i8_s, 4), "int8": i8_s <= PAYS * q8_s}

    return bool(cached_json("head_int8", machine_key(shapes=HEAD_SHAPES, pays=PAYS), measure)["int8"])


def time_head_kernels(q8, shapes=HEAD_SHAPES, rows=HEAD_ROWS, rounds: int = 5,
                      repeats: int = 10) -> tuple[float, float]:
    """(Q8_0 seconds, int8 seconds): one pass over ``shapes`` [N, K] at each of ``rows``, summed, best of ``rounds``
    passes that alternate the two kernels (a slow spell of the machine touches both). ``q8``: the bf16 block kernel.
    """
    g = torch.Generator().manual_seed(0)
    q8_blocks, i8_rows = [], []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        i8_rows.append(Int8Rows.quantize(w))
        blocks = torch.randint(-127, 128, (n, k // 32, 34), generator=g, dtype=torch.int8).view(torch.uint8)
        blocks[..., :2] = torch.tensor([0.0004], dtype=torch.float16).view(torch.uint8)  # each block's scale
        q8_blocks.append(blocks.reshape(n, -1))
    xs = [[torch.randn(r, k, generator=g).bfloat16() for _, k in shapes] for r in rows]
    kernel_calls = {
        "q8": lambda x, j: q8.linear(x, q8_blocks[j], 8, _EMPTY),  # 8: GGML's Q8_0
        "i8": lambda x, j: i8_rows[j].linear(x, None),
    }

    def one_pass(run) -> Callable[[], None]:
        def go() -> None:
            for x_r in xs:
                for j, x in enumerate(x_r):
                    run(x, j)
        return go

    with torch.inference_mode():
        best = best_alternating({name: one_pass(run) for name, run in kernel_calls.items()}, rounds, repeats)
    return best["q8"], best["i8"]


def set_prefetch_from_env() -> int:
    """Apply ``EYAS_HEAD_I8_PREFETCH`` (weight groups ahead, 0 off) to the kernel; returns it. Default: 0 where the
    weights are tiled (``tiles_in_use``; software prefetch on top of the hardware's measured slower there: the head's
    five projections at 1 / 3 rows 0.590 / 0.366 ms from DRAM and 0.215 / 0.305 from the caches with 2 groups,
    0.562 / 0.323 and 0.185 / 0.259 without, Zen 4, ``scripts/head_cold.py --dtype bfloat16 --distances 0,2``), else 2.
    """
    groups = prefetch_from_env()
    _kernel().set_prefetch(groups)
    return groups


def prefetch_from_env() -> int:
    """``EYAS_HEAD_I8_PREFETCH`` checked, or its default (``set_prefetch_from_env``); sets nothing."""
    return kernels.prefetch_env("EYAS_HEAD_I8_PREFETCH", 0 if tiles_in_use() else 2, "weight groups to prefetch ahead")


def int8_serves(w: torch.Tensor) -> bool:
    """A weight the kernel takes (``int8_head_ready`` first): [N, K] with K a multiple of its chunk (64 bytes), on a
    CPU.
    """
    return w.dim() == 2 and w.device.type == "cpu" and w.shape[1] % _kernel().chunk() == 0
