"""Exact-mode forwards of one sequence on the compiled kernels, layer by layer without the module tree.

A plain decoding step of SmolLM2 makes ~240 kernel calls (121 block projections, 60 norms, 30 RoPE/cache writes, 30
path attentions). Through the modules (``nn.Module`` calls and attribute lookups, ``eyas.models.exact.linear``'s
routing, each projection's operand lookup, ``fused_path_attend``'s checks) the Python between them cost 3.5 ms of an
11.0 ms token on the Intel Xeon 6/207: the same calls replayed alone took 7.5 ms. Where every piece is a compiled
kernel (each projection GGUF blocks on the bf16 block kernel, the layer-ops RoPE and cache write, the path kernel,
the norm kernel), ``DecodePlan.run`` makes the same calls in the same order on the same tensors from references
gathered once: the same bits as the modules' path (tests/models/test_decode_plan.py), so plain decoding and
verification may take either. A float32 model (a CPU without AVX512-BF16) plans the same calls on the float32 block
kernel, for the forwards ``eyas.models.exact.linear`` sends to it (decode and verify forwards of at most
``F32_ROWS`` rows; any forward where its AVX-512 build takes any number of rows). ``EYAS_DECODE_PLAN=0`` turns it
off.

For a bf16 model the loop itself is one native call where ``eyas/kernels/decode_step.cpp`` builds (``NativeStep``):
the same kernels and the same ATen ops in the same order, so the same bits again, without the ~150 small torch ops a
forward that cost ~5 us each from Python (a token's layers 6.76 -> ~5.5 ms on the Zen 4 VM). ``EYAS_DECODE_STEP=0``
keeps the Python loop.

    plan = DecodePlan.build(model)               # None where some piece is not a compiled kernel
    if plan is not None and plan.serves(tokens, attn, exact_prefill):
        x, taps = plan.run(x, rope, cache, attn.paths[0], meta.taps)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models import gguf_tuning
from eyas.models.attention import AttnMeta
from eyas.models.base import PathAttention
from eyas.models.gguf_blocks import F32_ROWS, GGUFBlocks, attached_blocks, block_kernel_for, f32_any_rows

_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class Projection:
    """One projection as the block kernel's ``linear`` takes it: blocks, type code, bias (empty for none)."""

    data: torch.Tensor
    code: int
    bias: torch.Tensor

    @classmethod
    def of(cls, mod: nn.Module, dtype: torch.dtype) -> Projection | None:
        blocks = attached_blocks(mod)
        if not isinstance(mod, nn.Linear) or not isinstance(blocks, GGUFBlocks):
            return None
        data, code = blocks.operands(dtype)
        return cls(data, code, _EMPTY if mod.bias is None else mod.bias)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's weights as its kernels read them."""

    norm1: torch.Tensor  # [D] input_layernorm
    norm2: torch.Tensor  # [D] post_attention_layernorm
    eps: float
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


@dataclass(frozen=True)
class DecodePlan:
    layers: tuple[LayerPlan, ...]
    heads: int
    kv_heads: int
    head_dim: int
    blocks: object  # the compiled modules, their functions looked up at each call (tests spy on them)
    norm: object
    ops: object
    dtype: torch.dtype  # the model's: bf16 (the bf16 block kernel) or float32 (the float32 one)
    native: NativeStep | None = None  # the layers' loop as one native call (bf16), or None: the Python loop

    @classmethod
    def build(cls, model: nn.Module) -> DecodePlan | None:
        """``model``'s plan (a NativeLlama), or None where a piece is missing: a bf16 or float32 CPU model whose
        every layer has GGUF-block projections and no q/k norms, with the block, norm and layer-ops kernels built.
        """
        if os.environ.get("EYAS_DECODE_PLAN", "1") == "0" or model.dtype not in (torch.bfloat16, torch.float32):
            return None
        kernel, norm, ops = block_kernel_for(model.dtype), kernels.rms_norm(), kernels.LAYER_OPS()
        if kernel is None or norm is None or ops is None or model.device.type != "cpu":
            return None
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = [Projection.of(m, model.dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                              mlp.down_proj)]
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            if attn.q_norm is not None or any(p is None for p in projs) or n1.eps != n2.eps:
                return None
            layers.append(LayerPlan(n1.weight, n2.weight, n1.eps, *projs))
        c = model.config
        layers = tuple(layers)
        native = NativeStep.build(layers, c.num_heads, c.num_kv_heads, c.head_dim, model.dtype)
        return cls(layers, c.num_heads, c.num_kv_heads, c.head_dim, kernel, norm, ops, model.dtype, native)

    def serves(self, tokens: torch.Tensor, attn: AttnMeta, exact_prefill: bool) -> bool:
        """Whether a forward of ``tokens`` [B, T] under ``attn`` runs as the modules would run it on these kernels:
        one sequence through the path kernel, every projection on the blocks (``eyas.models.exact.linear``'s
        routing: bf16 decode / verify forwards, and exact prefill where bf16 prefill reads the blocks; float32 ones of
        at most ``F32_ROWS`` rows that are not exact prefill, any forward where the float32 kernel takes any rows).
        """
        paths = attn.paths
        if paths is None or len(paths) != 1 or paths[0].kernel is None or tokens.shape[0] != 1:
            return False
        if tokens.shape[1] != paths[0].order.shape[0] or tokens.device.type != "cpu":
            return False
        if self.dtype == torch.float32:
            return f32_any_rows() or (not exact_prefill and tokens.shape[1] <= F32_ROWS)
        return not exact_prefill or gguf_tuning.prefill_on_blocks()

    def run(self, x: torch.Tensor, rope, cache: KVCache, pa: PathAttention, taps) -> tuple[torch.Tensor, dict]:
        """x: [1, N, D] embeddings (the model's dtype) -> ([1, N, D] the last layer's output, {layer: [1, N, D] its
        input} for ``taps``), writing every layer's keys and values into ``cache`` at ``pa``'s slots.
        """
        cos, sin = rope.rows
        scale = self.head_dim**-0.5
        if self.native is not None:
            return self.native.run(x, cos, sin, cache, pa, taps, scale)
        n, h, hk, dh = x.shape[1], self.heads, self.kv_heads, self.head_dim
        lin, norm, rope_cache = self.blocks.linear, self.norm.rms_norm, self.ops.rope_cache
        x = x[0]
        tapped = {}
        for (kc, vc), (i, p) in zip(layer_caches(cache), enumerate(self.layers), strict=True):
            if i in taps:
                tapped[i] = x[None]
            qkv = lin(norm(x, p.norm1, p.eps), p.qkv.data, p.qkv.code, p.qkv.bias).view(n, h + 2 * hk, dh)
            q = rope_cache(qkv, cos, sin, kc, vc, pa.start, h)  # [N, H, Dh] float32
            y = pa.kernel.path_attention(q, kc, vc, pa.start, pa.slots, pa.lengths, scale)
            x = x + lin(y.to(x.dtype).view(n, h * dh), p.o.data, p.o.code, p.o.bias)
            gu = lin(norm(x, p.norm2, p.eps), p.gate_up.data, p.gate_up.code, p.gate_up.bias)  # [N, 2I]: gate | up
            half = gu.shape[1] // 2
            x = x + lin(F.silu(gu[:, :half]) * gu[:, half:], p.down.data, p.down.code, p.down.bias)
        return x[None], tapped


@dataclass(frozen=True)
class NativeStep:
    """``DecodePlan.run``'s loop for a bf16 model as one call of ``eyas/kernels/decode_step.cpp`` (the same bits)."""

    step: object  # the compiled DecodeStep, holding every layer's weights
    layers: int

    @classmethod
    def build(cls, layers: tuple[LayerPlan, ...], heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> NativeStep | None:
        """The native loop over ``layers``, or None where it does not serve: not bf16, the kernel is off
        (``EYAS_DECODE_STEP=0``) or unbuilt. Its copy of the block kernel takes this process's tuning.
        """
        if dtype != torch.bfloat16 or not layers:
            return None
        mod = kernels.decode_step()
        if mod is None or not mod.available():
            return None
        gguf_tuning.set_on(mod, gguf_tuning.active())
        args = [(p.norm1, p.norm2, *((q.data, q.code, q.bias) for q in (p.qkv, p.o, p.gate_up, p.down)))
                for p in layers]
        return cls(mod.DecodeStep(args, layers[0].eps, heads, kv_heads, head_dim), len(layers))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, pa: PathAttention, taps,
            scale: float) -> tuple[torch.Tensor, dict]:
        """As ``DecodePlan.run``: x [1, N, D] -> ([1, N, D], {layer: [1, N, D] its input} for ``taps``)."""
        views = layer_caches(cache)
        order = sorted(i for i in set(taps) if 0 <= i < self.layers)  # the layers the Python loop taps
        out, tapped = self.step.run(x[0], cos, sin, [k for k, _ in views], [v for _, v in views], pa.start,
                                    pa.slots, pa.lengths, scale, order)
        return out[None], {i: t[None] for i, t in zip(order, tapped, strict=True)}


def layer_caches(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) [Hk, S, Dh] of ``cache``'s first sequence, as views made once per pair of cache
    tensors (``cache.k[i, 0]`` and ``cache.v[i, 0]`` cost four dispatched selects a layer a forward; with chunk's
    split and narrows gone too, plain decoding +4 % on the Zen 3 VM).
    """
    memo = cache.__dict__.get("_plan_views")
    if memo is None or memo[0] is not cache.k or memo[1] is not cache.v:
        memo = cache.__dict__["_plan_views"] = (cache.k, cache.v, [(k[0], v[0]) for k, v in zip(cache.k, cache.v,
                                                                                             strict=True)])
    return memo[2]
