"""CPU inference projections on oneDNN-prepacked weights (bf16; float32 past a streaming kernel's few rows).

``F.linear`` on a CPU hands a bf16 weight to oneDNN in its plain [N, K] layout on every call, and
oneDNN re-lays it out (packs it) each time; for the few rows of decoding that repacking costs more
than the product. ``PackedLinear`` keeps a packed copy (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's weight freezing uses) and multiplies with ``torch.ops.mkldnn._linear_pointwise``:
the same oneDNN kernel, so the same bits as ``F.linear`` for every row count (checked for SmolLM2's
shapes at 1-100 rows, tests/models/test_packed.py). Exact mode's row floors and every identity
therefore carry over unchanged.

Measured on the AVX512-BF16 VM (Zen 5, 2 threads, SmolLM2's four projections of one layer, µs):
1 row 268 -> 113, 6 rows 297 -> 127, 16 rows 388 -> 203, 64 rows 952 -> 595; the [49152, 576]
vocabulary projection 2.49 -> 0.63 ms at 1 row, 7.4 -> 4.7 ms at 64 (docs/benchmarks.md).

The copy is made at the first inference forward and remade when the weight's storage or version
changes (``.to()``, a load); autograd, other dtypes and other devices take ``F.linear``. It costs
a second copy of each weight (SmolLM2-135M in bf16: +270 MB), so packing stops once the copies
would pass a quarter of the machine's memory; ``EYAS_PACK_WEIGHTS=0`` turns it off.

float32 past the streaming kernel's rows (prefill chunks): the same oneDNN product on a prepacked float32 copy
instead of MKL's ``sgemm``, which repacks the weight every call: SmolLM2's 120 layer projections 105 ms instead of
189 at 40 rows, 231 instead of 294 at 100 (AVX2 VM, 2 threads; ``scripts/prefill_ab.py --rows 40,100 --gemm``; a
prompt 1.19-1.78x faster end to end). It gives a row the same bits at every row count (checked 1-300 rows for
SmolLM2's shapes; exact mode's row floors are probed for it under their own key, ``gemm_kind``), not MKL's bits.
``EYAS_PACK_WEIGHTS=0`` keeps MKL.

float32 (the dtype on CPUs without native bf16): MKL's sgemm re-reads the weight for 2-16 rows, so a
verify forward of a few tree nodes cost 1.5x a plain step on the AVX2 VM. Up to ``skinny_rows`` rows
go through ``eyas/kernels/skinny_gemm.cpp`` instead, which streams each weight once and computes
every row in one fixed order: a row's output is the same bits alone or among others (plain decoding
and verification agree exactly in the projections). Measured on the AVX2 VM, 2 threads, weight warm
in cache, ms at 1 / 2 / 8 / 16 rows: [3072, 576] 0.34 / 0.70 / 0.72 / 1.10 -> 0.10 / 0.16 / 0.48 / 1.04; [49152, 576]
9.5 / 19.9 / 23.2 / 26.3 -> 4.3 / 4.3 / 8.7 / 12.5 (docs/benchmarks.md). ``EYAS_SKINNY_GEMM=0`` or a
machine without a C++ compiler keeps ``F.linear``.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.models.cpu import cpu_flags, native_bf16
from eyas.models.gguf_blocks import BLOCKS_ATTR, FAST_ROWS, GGUFBlocks, attached_blocks, blocks_of, f32_any_rows

_lock = threading.Lock()
_packed_bytes = 0  # all PackedLinear copies made in this process


def _switched_off() -> bool:
    return os.environ.get("EYAS_PACK_WEIGHTS", "1") == "0"


def _available() -> bool:
    if _switched_off():
        return False
    if cpu_flags() and not native_bf16():
        # oneDNN emulates bf16 there, and its packed product is not F.linear's bits for every shape (Intel Ice Lake,
        # [49152, 576] at one row); such CPUs run float32 anyway (--dtype auto)
        return False
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


_AVAILABLE = _available()


def _available_f32() -> bool:
    if _switched_off():
        return False
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


_AVAILABLE_F32 = _available_f32()


def _budget() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class PackedLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose bf16 CPU inference runs on a packed weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]: the GGUF-block kernel for a few bf16 rows where the weight has blocks
        (eyas.models.gguf_blocks), else ``dense``.
        """
        blocks = blocks_of(self, x)
        if blocks is not None and x.numel() <= FAST_ROWS * x.shape[-1]:
            return blocks.linear(x, self.bias)
        blocks = many_rows_blocks(self, x)
        if blocks is not None:
            return blocks.linear(x, self.bias)
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] on the dense weight: oneDNN prepacked (bf16), the streaming kernel (few fp32
        rows; from the weight's GGUF blocks where it has them, the same bits) or ``F.linear``. Exact mode's prefill
        and row-floor probes take this path only.
        """
        kernel = skinny_kernel(self.weight, x)
        if kernel is not None:
            blocks = attached_blocks(self)
            if blocks is not None:  # the same sums from the GGUF file's blocks, 5.5x fewer bytes (gguf_f32.cpp)
                return blocks.linear(x, self.bias)
            out = kernel.linear(x.reshape(-1, x.shape[-1]), self.weight, _EMPTY if self.bias is None else self.bias)
            return out.view(*x.shape[:-1], self.weight.shape[0])
        packed = self._packed(x)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def gemm_kind(self) -> str:
        """What ``dense`` multiplies with past the streaming kernel's rows, for exact mode's row-floor cache key
        (eyas.models.exact.RowFloor): a float32 weight's oneDNN product rounds unlike MKL's.
        """
        if self.weight.dtype == torch.float32 and _AVAILABLE_F32:
            return "PackedLinear+dnnl-f32"
        return "PackedLinear"

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickle) leave the packed weight behind (an opaque tensor): they pack their own."""
        state = dict(super().__getstate__())
        state.pop("_eyas_packed", None)
        state.pop(BLOCKS_ATTR, None)
        return state

    def _packed(self, x: torch.Tensor) -> torch.Tensor | None:
        w = self.weight
        on = _AVAILABLE if w.dtype == torch.bfloat16 else _AVAILABLE_F32 and w.dtype == torch.float32
        if not (on and x.dtype == w.dtype and w.device.type == "cpu"):
            return None
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return None
        key = (w.data_ptr(), w._version)
        held = self.__dict__.get("_eyas_packed")
        if held is not None and held[0] == key:
            return held[1]
        return self._pack(w, key, held)

    def _pack(self, w: torch.Tensor, key: tuple, held) -> torch.Tensor | None:
        global _packed_bytes
        size = w.numel() * w.element_size()
        with _lock:
            if held is None:  # a first copy counts against the budget; a remade one replaces its old self
                if _packed_bytes + size > _budget():
                    return None
                _packed_bytes += size
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self.__dict__["_eyas_packed"] = (key, packed)
        return packed


# float32 fast mode: up to this many rows the block kernel's AVX-512 build beats MKL's GEMM (at 17-48 rows MKL costs
# 2.3-4x the kernel on the Ice Lake VM, at 96 1.12x, at 128 1.04x, at 256 0.90x: scripts/prefill_ab.py --rows)
F32_GEMM_ROWS = 128


def many_rows_blocks(mod: nn.Module, x: torch.Tensor) -> GGUFBlocks | None:
    """``mod``'s GGUF blocks for float32 CPU inference of up to ``F32_GEMM_ROWS`` rows where their kernel takes that
    many (its AVX-512 build, ``f32_any_rows``; up to the streaming kernel's rows ``dense`` reads them too, the same
    sums), else None (past the streaming kernel's rows, MKL's GEMM): fast mode's
    prefill chunks, ``eyas data``'s batched rows, a draft head's fused taps over a prompt. Exact mode reads the blocks
    at every count (eyas.models.exact.linear). A head's int8 rows stay on the GEMM: measured slower past 16 rows.
    """
    blocks = attached_blocks(mod)
    if not isinstance(blocks, GGUFBlocks) or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if (torch.is_grad_enabled() and x.requires_grad) or x.numel() > F32_GEMM_ROWS * x.shape[-1] or not f32_any_rows():
        return None
    return blocks


_EMPTY = torch.empty(0)
_skinny = kernels.Lazy(kernels.skinny_gemm)  # built (or found missing) once per process


def skinny_rows(w: torch.Tensor) -> int:
    """The most rows the float32 streaming kernel takes for weight ``w`` [N, K]: past that it is compute-bound
    and MKL's blocked GEMM wins (16 rows; 32 for vocabulary-sized weights, measured on the AVX2 VM).
    """
    return 32 if w.numel() >= (1 << 22) else 16


def skinny_kernel(w: torch.Tensor, x: torch.Tensor):
    """The compiled kernel where it serves ``x @ w.T`` (float32 CPU inference, few rows), else None."""
    if not (w.dtype == torch.float32 and x.dtype == torch.float32 and w.device.type == "cpu" and x.dim() >= 1):
        return None
    if x.numel() > skinny_rows(w) * w.shape[1] or not w.is_contiguous():
        return None
    if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
        return None
    return _skinny()


def skinny_gemm_ready() -> bool:
    """Whether float32 few-row projections run on the streaming kernel here (built on first call)."""
    probe = torch.zeros(1, 8)
    with torch.inference_mode():
        return skinny_kernel(probe, probe) is not None


def packed_weights() -> bool:
    """Whether PackedLinear packs bf16 weights on this machine (oneDNN bf16 available, not turned off)."""
    return _AVAILABLE


def pack_linears_(model: nn.Module) -> int:
    """Make every plain nn.Linear under ``model`` a PackedLinear in place (class swap: parameters, names
    and state dict unchanged); returns the count. Packing itself waits for the first bf16 CPU forward (float32: the
    first past the streaming kernel's rows).
    """
    count = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = PackedLinear
            count += 1
    return count
