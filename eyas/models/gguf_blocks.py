"""bf16 decoding straight from a GGUF file's blocks: the same weights, 2.7x fewer bytes per token.

A target loaded from a GGUF file (the embedded default, ``--model file.gguf``) is dequantised once into
a bf16 model. A decode step of a small model on a CPU is bound by streaming those weights (SmolLM2-135M:
269 MB a token in bf16, 98 MB as Q4_1/Q8_0 blocks). ``attach_gguf_blocks`` keeps each projection's raw
blocks beside its bf16 weight; ``eyas/kernels/gguf_bf16.cpp`` rebuilds every bf16 weight from its block in
registers (gguf-py's float32 formula, round to nearest even) and multiplies with AVX512-BF16. The weights
are therefore the loaded ones bit for bit (checked for every row here, at load); only the summation order
differs from oneDNN's, and it is fixed per row (row-invariant), so exact mode runs decode and verification
forwards on it with no padding.

Where it serves (``linear``): bf16 CPU inference, no autograd, a weight with blocks; in fast mode up to
``FAST_ROWS`` rows (past that oneDNN's blocked GEMM is faster), in exact mode's decode and verification
forwards at every row count; prefill too where the kernel runs several rows in FMAs (eyas.models.gguf_tuning.
prefill_on_blocks), else oneDNN. ``EYAS_GGUF_BLOCKS=0`` turns it off.

float32 (CPUs without native bf16): the model is dequantised into float32 (540 MB a token for SmolLM2-135M) and
``eyas/kernels/gguf_f32.cpp`` rebuilds each float32 weight from its block the same way. It serves exactly where the
few-row streaming kernel (``eyas/kernels/skinny_gemm.cpp``, eyas.models.packed) would and sums in its order, so
every output is the same bits as before, read from 5.5x fewer bytes. Its AVX-512 build takes any number of rows
(``f32_any_rows``): exact mode's prefill then reads the blocks as well, unpadded, instead of padding each chunk to
the dense GEMM's row floor (a 41-token prompt's prefill 100 -> 47 ms on the Ice Lake VM, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eyas import kernels
from eyas.models.int8_rows import Int8Rows, int8_head_ready, int8_serves, set_prefetch_from_env

# fast mode: the most rows the block kernel takes (oneDNN's prepacked GEMM is as fast at 8 and faster past it)
FAST_ROWS = 8
# float32 without AVX-512: the most rows ``eyas/kernels/gguf_f32.cpp`` takes (its MAX_ROWS, the streaming kernel's)
F32_ROWS = 32
_SUPPORTED = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # GGML type name -> id
_PACKABLE = (2, 3)  # Q4_0, Q4_1: types the bf16 kernel reads in its own layout (GGUFBlocks.operands)

# fused native projection -> the GGUF tensors concatenated into it, in row order
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@dataclass
class GGUFBlocks:
    """One projection's weight as GGUF blocks: ``data`` [N, K / 32 * block bytes] uint8, GGML type ``qtype``."""

    data: torch.Tensor
    qtype: int
    k: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [..., K] bf16 or float32 (at most the float32 kernel's ``max_rows()`` rows) -> [..., N], x's dtype."""
        data, code = self.operands(x.dtype)
        out = _KERNELS[x.dtype]().linear(x.reshape(-1, self.k), data, code, _EMPTY if bias is None else bias)
        return out.view(*x.shape[:-1], out.shape[1])

    def operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """(blocks, type code) the kernel for ``dtype`` reads: for bf16 and Q4 types the bf16 kernel's packed layout
        (the same bytes regrouped: a row's nibbles, then its scales; made at the first call and kept, ``pack`` in
        eyas/kernels/gguf_q4_packed.h), else ``data`` and ``qtype`` as the GGUF file has them.
        """
        if dtype != torch.bfloat16:
            return self.data, self.qtype
        packed = self.__dict__.get("_packed")
        if packed is None:
            packed = self.__dict__["_packed"] = self.layout_for(_kernel())
        return packed

    def layout_for(self, kernel) -> tuple[torch.Tensor, int]:
        """(blocks, type code) as the bf16 ``kernel`` module reads them, made now: its packed layout of Q4 blocks
        where it has one (not a build before the layout: scripts/kernel_ab.py's base), else the GGUF file's.
        """
        if kernel is None or self.qtype not in _PACKABLE or not hasattr(kernel, "pack"):
            return self.data, self.qtype
        return kernel.pack(self.data, self.qtype, self.k), kernel.packed_type() + self.qtype

    @classmethod
    def cat(cls, parts: list[GGUFBlocks]) -> GGUFBlocks:
        """Several projections over the same input (one type, one K) as one: their rows in order, one kernel call."""
        return cls(data=torch.cat([p.data for p in parts]), qtype=parts[0].qtype, k=parts[0].k)


_EMPTY = torch.empty(0)
_kernel = kernels.Lazy(kernels.gguf_bf16, usable=lambda k: k.available())  # None on a CPU without AVX512-BF16
_kernel_f32 = kernels.Lazy(kernels.gguf_f32, usable=lambda k: k.available())  # None on a CPU without AVX2/FMA
_KERNELS = {torch.bfloat16: _kernel, torch.float32: _kernel_f32}


@functools.cache
def f32_any_rows() -> bool:
    """Whether the float32 block kernel takes any number of rows (its AVX-512 build): then exact mode's prefill
    reads the blocks too (row-invariant at every count: no padding, the same bits in any chunking) instead of a dense
    float32 GEMM (MKL at 17-48 rows cost 2.3-4x the kernel on the Ice Lake VM, docs/benchmarks.md).
    """
    kernel = _kernel_f32()
    return kernel is not None and kernel.max_rows() > 1 << 30


def block_kernel():
    """The compiled bf16 kernel module, or None where it is off, unavailable or cannot be built."""
    return _kernel()


def block_kernel_for(dtype: torch.dtype):
    """The compiled block kernel for activations of ``dtype`` (bf16 or float32), or None as ``block_kernel``."""
    return _KERNELS[dtype]() if dtype in _KERNELS else None


BLOCKS_ATTR = "_eyas_blocks"  # kept in a module's __dict__: not a parameter, buffer or submodule, so no state dict


def attached_blocks(mod: nn.Module) -> GGUFBlocks | Int8Rows | None:
    """The quantised rows attached to projection ``mod`` (its GGUF blocks, or a draft head's int8 rows), else None."""
    return mod.__dict__.get(BLOCKS_ATTR)


def set_blocks(mod: nn.Module, rows: GGUFBlocks | Int8Rows) -> None:
    mod.__dict__[BLOCKS_ATTR] = rows


def blocks_of(mod: nn.Module, x: torch.Tensor) -> GGUFBlocks | None:
    """``mod``'s blocks where the kernel serves ``x`` (bf16 CPU inference), else None."""
    blocks = attached_blocks(mod)
    if blocks is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    return blocks


def attach_gguf_blocks(model: nn.Module, gguf_path: str | Path) -> int:
    """Give every projection of a native bf16 or float32 CPU ``model`` loaded from ``gguf_path`` its GGUF blocks.

    Each projection's blocks are dequantised by the kernel and compared with its loaded weight, bit for bit; a
    projection whose blocks do not give its weight (another type, another row order) keeps the dense path.
    Returns the number of projections that read blocks (0 where the kernel is off or unavailable).
    """
    if os.environ.get("EYAS_GGUF_BLOCKS", "1") == "0" or model.device.type != "cpu":
        return 0
    kernel = _KERNELS.get(model.dtype, lambda: None)()
    if kernel is None:
        return 0
    tensors = file_tensors(gguf_path)
    cfg = model.config
    count = 0
    for i, layer in enumerate(model.model.layers):
        for name, parts in _LAYER_PARTS.items():
            mod = layer.get_submodule(name)
            count += _attach(mod, [tensors.get(f"blk.{i}.{p}.weight") for p in parts], parts, cfg, kernel)
    head = tensors.get("output.weight") if "output.weight" in tensors else tensors.get("token_embd.weight")
    count += _attach(model.lm_head_proj, [head], ("output",), cfg, kernel)
    return count


def file_tensors(gguf_path: str | Path) -> dict:
    """A GGUF file's tensors by name (``.tensor_type``, ``.data`` as gguf-py gives them): eyas.formats.gguf_index's
    quick read of the tensor table, or gguf-py's full reader for a file that one does not understand.
    """
    from eyas.formats.gguf_index import GGUFIndexError, read_tensors

    try:
        return {t.name: t for t in read_tensors(gguf_path)}
    except GGUFIndexError:
        import gguf

        return {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """w: [N, K] (K a multiple of 32) -> [N, K / 32 * 34] uint8 GGML Q8_0 blocks: per 32 weights an fp16 scale
    d = max |w| / 127, then round(w / d) as int8 (the scale rounded to fp16 first, so the quants fit the scale
    the kernel reads).
    """
    n, k = w.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs a multiple of 32 input features, got {k}")
    blocks = w.detach().float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16)  # [N, K / 32]
    inv = torch.where(d > 0, 1 / d.float().clamp(min=1e-30), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[..., :2] = d.view(torch.uint8).reshape(n, k // 32, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(n, -1)


def quantize_head_(head: nn.Module) -> int:
    """A draft head's bf16 or float32 CPU projections as Q8_0 blocks on the block kernel: each weight is replaced,
    in place, by its Q8_0 rounding (the same weights on both paths: the kernel up to ``FAST_ROWS`` rows in bf16,
    the streaming kernel's rows in float32, the dense GEMM past them). Where the int8 kernel serves the head
    (eyas.models.int8_rows: AVX512-VNNI or AVX2, a float32 head by default) every projection but the fused taps
    ``fc`` is per-row int8 instead (``Int8Rows``, same protocol); ``fc`` keeps Q8_0 (int8 rows there cost ~1.5 points
    of top-1: its input concatenates three layers' residuals of very different scales).

    A head runs right after a verify forward has streamed the target's weights through the caches, so its
    own weights come from DRAM every step: 1.06 bytes a weight instead of 2 halves that read. The draft
    changes by the rounding (about 0.4 % of a block's largest weight); verification keeps the output lossless.
    Returns the number of projections; 0 where the kernel is unavailable, the head is not bf16 or float32 on a CPU,
    or ``EYAS_HEAD_Q8=0``.
    """
    mods = {name: m for name, m in head.named_modules() if isinstance(m, nn.Linear) and attached_blocks(m) is None
            and m.weight.dtype in _KERNELS and m.weight.device.type == "cpu" and m.weight.shape[1] % 32 == 0}
    dtypes = {m.weight.dtype for m in mods.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    # the kernel is compiled only where it would serve (not for a head on a GPU)
    kernel = _KERNELS[dtype]() if dtype is not None and os.environ.get("EYAS_HEAD_Q8", "1") != "0" else None
    if kernel is None:
        return 0
    int8 = int8_head_ready(dtype)
    if int8:
        set_prefetch_from_env()
    for name, mod in mods.items():
        w = mod.weight
        if int8 and name != "fc" and int8_serves(w):
            rows = Int8Rows.quantize(w)
            with torch.no_grad():
                w.copy_(rows.dequantize())
            set_blocks(mod, rows)
            continue
        data = quantize_q8_0(w)
        with torch.no_grad():
            w.copy_(kernel.dequantize(data, _SUPPORTED["Q8_0"], w.shape[1]))
        set_blocks(mod, GGUFBlocks(data=data, qtype=_SUPPORTED["Q8_0"], k=w.shape[1]))
    return len(mods)


def _attach(mod: nn.Module, tensors: list, parts: tuple[str, ...], cfg, kernel) -> int:
    if not isinstance(mod, nn.Linear) or any(t is None for t in tensors):
        return 0
    types = {t.tensor_type.name for t in tensors}
    if len(types) != 1 or next(iter(types)) not in _SUPPORTED:
        return 0
    qtype = _SUPPORTED[types.pop()]
    k = mod.weight.shape[1]
    rows = [_rows(t, p, cfg) for t, p in zip(tensors, parts, strict=True)]
    data = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows)))
    if data.shape != (mod.weight.shape[0], k // 32 * kernel.block_bytes(qtype)):
        return 0
    bits = torch.int16 if mod.weight.dtype == torch.bfloat16 else torch.int32  # compare bit patterns, not values
    if not torch.equal(kernel.dequantize(data, qtype, k).view(bits), mod.weight.detach().view(bits)):
        return 0
    set_blocks(mod, GGUFBlocks(data=data, qtype=qtype, k=k))
    return 1


def _rows(t, part: str, cfg) -> np.ndarray:
    """A GGUF tensor's block rows [N, bytes] in the loaded (Hugging Face) row order.

    llama.cpp's converter interleaves the rows of q and k for its RoPE; transformers undoes that at load
    (``reverse_permute``): head h's rows (2i, 2i + 1) of each pair go back to (i, i + dim / 2).
    """
    data = np.asarray(t.data)
    if part not in ("attn_q", "attn_k"):
        return data
    heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
    dim = data.shape[0] // heads // 2
    order = np.arange(data.shape[0]).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)
    return data[order]
