"""A draft head's decoder layer on the compiled CPU kernels: a handful of calls where torch runs ~40 ops.

A head step on the CPU is a few rows through one small layer, right after a verify forward has pushed the
head's code and data out of the caches; measured in the step (Zen 5 VM, bf16), each torch op there costs
5-12 us of dispatch, so the ~40 ops of a layer (three q/k/v projections, RoPE as neg/cat/mul/add for q and k,
transposes, the cache write, the mask, fp32 attention, two MLP projections) cost more than its weights.
Here the same layer is:

    qkv = blocks(q | k | v)(x)                # one projection: the three Q8_0 weights' rows, concatenated
    q   = rope_cache(qkv, cos, sin, cache)    # RoPE, k and v into the head's cache, q in float32
    y   = path_attention(q, cache, paths)     # each row: every committed slot, then its own path's slots
    x   = residual + o_proj(y)
    x   = x + down(silu(gate) * up),  gate | up = blocks(gate | up)(norm(x))

``HeadPaths`` replaces the [T, S] mask: a row attends every slot below ``prefix`` (the committed context)
and then its own ``slots`` (its ancestors in the draft tree and itself; for ``extend``, the new rows up to
its own). Only the draft changes (RoPE's rounding, the attention's summation order: about one bf16 ulp);
verification keeps the output lossless. A float32 head runs the same calls on the float32 block kernel (RoPE then
rounds as torch's float32 does). Where a piece is missing (a GPU, no block kernel for the head's dtype, more than
``FAST_ROWS`` rows, q/k norms or biases) the head keeps its torch path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models.gguf_blocks import FAST_ROWS, attached_blocks
from eyas.models.layers import rms_norm


@dataclass
class HeadPaths:
    """What each of T new rows attends in the head's cache: slots 0 .. prefix - 1, then ``slots[r, :lengths[r]]``."""

    prefix: int
    # [T, P] long absolute slots, row r's path in order (its own slot last); padded past lengths[r]
    slots: torch.Tensor
    # [T] long, entries of each row's path (>= 1)
    lengths: torch.Tensor

    @classmethod
    def causal(cls, start: int, t: int) -> HeadPaths:
        """T rows written at slots start .. start + T - 1, row i attending the committed slots and rows 0 .. i."""
        slots = torch.arange(start, start + t).expand(t, t).contiguous()
        return cls(prefix=start, slots=slots, lengths=torch.arange(1, t + 1))

    @classmethod
    def from_seen(cls, prefix: int, seen: list[list[int]]) -> HeadPaths:
        """seen[r]: ascending entries j of the drafted nodes fed so far (this feed's last) that row r attends,
        at slots prefix + j.
        """
        paths = [[prefix + j for j in row] for row in seen]
        width = max(len(p) for p in paths)
        return cls(prefix=prefix, slots=torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths]),
                   lengths=torch.tensor([len(p) for p in paths]))


def fuse_head_blocks_(head: nn.Module) -> int:
    """Give every attention (q/k/v) and MLP (gate/up) of a quantised head one fused block matrix (their
    Q8_0 rows concatenated: the same weights, one kernel call). Returns how many were fused; 0 where the head's
    projections have no blocks (``quantize_head_`` did not run), differ in dtype, carry biases, or
    ``EYAS_HEAD_FAST=0``.
    """
    if os.environ.get("EYAS_HEAD_FAST", "1") == "0":
        return 0
    count = 0
    for mod in head.modules():
        parts = fused_parts(mod)
        if parts is None:
            continue
        blocks = [attached_blocks(p) for p in parts]
        if any(b is None for b in blocks) or any(p.bias is not None for p in parts):
            continue
        if len({p.weight.dtype for p in parts}) != 1:
            continue
        if len({(type(b), getattr(b, "qtype", None), b.k) for b in blocks}) != 1:
            continue
        mod.__dict__["_eyas_fused"] = type(blocks[0]).cat(blocks)  # GGUFBlocks or Int8Rows: one kernel call
        count += 1
    return count


def fused_parts(mod: nn.Module) -> list[nn.Linear] | None:
    """The projections ``fuse_head_blocks_`` fuses in ``mod`` (an attention's q/k/v, an MLP's gate/up), or None."""
    if all(hasattr(mod, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return [mod.q_proj, mod.k_proj, mod.v_proj]
    if all(hasattr(mod, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return [mod.gate_proj, mod.up_proj]
    return None


_ops = kernels.LAYER_OPS
_attention = kernels.Lazy(kernels.path_attention)


def fast_layer_ready(attn: nn.Module, mlp: nn.Module) -> bool:
    """The layer's fused blocks and the kernels are there, and the attention shape is one the kernel serves."""
    if "_eyas_fused" not in attn.__dict__ or "_eyas_fused" not in mlp.__dict__:
        return False
    if getattr(attn, "q_norm", None) is not None or attn.o_proj.bias is not None:
        return False
    ops, pk = _ops(), _attention()
    return ops is not None and pk is not None and pk.supports(attn.h // attn.hk, attn.dh)


def fast_layer(attn: nn.Module, mlp: nn.Module, post_norm: nn.Module, attn_in: torch.Tensor, residual: torch.Tensor,
               rope_rows: tuple[torch.Tensor, torch.Tensor], cache: KVCache, write_start: int,
               paths: HeadPaths, layer: int = 0) -> torch.Tensor:
    """One decoder layer for T <= FAST_ROWS rows (``fast_layer_ready`` first).

    attn_in: [T, D_in] bf16 or float32 (the head's dtype), what q/k/v read; residual: [T, D], what the attention
    output adds to; rope_rows: (cos, signed sin) [T, Dh] in that dtype; the rows' k and v go to slots
    write_start .. write_start + T - 1 of ``cache`` layer ``layer`` (one sequence, float32). Returns [T, D] in the
    head's dtype, the layer's output before any final norm.
    """
    t = attn_in.shape[0]
    if t > FAST_ROWS:
        raise ValueError(f"fast_layer serves up to {FAST_ROWS} rows, got {t}")
    h, hk, dh = attn.h, attn.hk, attn.dh
    qkv = attn.__dict__["_eyas_fused"].linear(attn_in, None).view(t, h + 2 * hk, dh)
    kc, vc = cache.k[layer, 0], cache.v[layer, 0]  # [Hk, S, Dh]
    q = _ops().rope_cache(qkv, rope_rows[0], rope_rows[1], kc, vc, write_start, h)  # [T, H, Dh] float32
    y = _attention().path_attention(q, kc, vc, paths.prefix, paths.slots, paths.lengths, dh**-0.5)
    x = residual + attn.o_proj(y.view(t, h * dh).to(residual.dtype))
    gate, up = mlp.__dict__["_eyas_fused"].linear(rms_norm(x, post_norm), None).chunk(2, dim=-1)
    return x + mlp.down_proj(F.silu(gate) * up)
