"""Attention of the native target: the fast path, and exact mode's row-invariant path.

Inputs are in [B, T, N, Dh] ("BTHD", straight out of the fused q/k/v projection); the KV cache
is [B, Hk, S, Dh] per layer. On a CPU, a bfloat16 model keeps its cache in float32 (values are
rounded to bfloat16 first, so the cache holds exactly what a bf16 cache would) because torch's
fused CPU attention is slow in bf16: 0.30 ms for one query over 300 keys against 0.04 ms in
fp32, measured on the AVX512-BF16 VM (docs/benchmarks.md, "Hot path").

Exact mode (``PathAttention``): every query row r reads its own mirror row of the cache holding
the committed prefix followed by r's root-to-node path in consecutive slots, the layout plain
decoding produces, and is computed as one small GEMM per (row, KV head) of fixed shape
[G, Dh] x [Dh, S] plus a row softmax, where S = ``kv_len`` is a multiple of ``KV_BLOCK``. Measured
(tests/models/test_path_attention.py): with S a multiple of 64 these results do not depend on S
(trailing masked slots) nor on how many rows share the call, at 1 and 2 threads, whereas torch's
fused kernel splits work across threads so that a row's rounding depends on the other rows.
A plain step is the same computation with one row whose mirror is the cache itself, so a token
gets the same bits whether plain decoding or a tree verified it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models.base import PathAttention

# exact mode's key lengths are multiples of this (see the module docstring)
KV_BLOCK = 64


def round_up(n: int, block: int = KV_BLOCK) -> int:
    return -(-n // block) * block


@dataclass
class AttnMeta:
    """Where the new tokens go and what they may attend (one object per forward, read by every layer)."""

    # cached slots before the new tokens: an int, or [B] long (one committed length per row)
    start: int | torch.Tensor
    # keys attended: slots 0 .. kv_len (path attention: each PathAttention's own)
    kv_len: int
    # [B, 1, T, S] bool (True = may attend), or None = causal / every slot < kv_len
    mask: torch.Tensor | None = None
    # exact mode: one PathAttention per batch row (its tree's first N_b of the T tokens), instead of ``mask``
    paths: list[PathAttention] | None = None
    # one-token batched decode through the compiled kernel (eyas.kernels): [B] long slots attended per row
    lengths: torch.Tensor | None = None
    kernel: object | None = None
    # a fresh causal pass (slots 0 .. T - 1, no mask): SDPA's own is_causal, which its flash kernels take
    causal: bool = False


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
           meta: AttnMeta) -> torch.Tensor:
    """q: [B, T, H, Dh]; k, v: [B, T, Hk, Dh] (new entries) -> [B, T, H, Dh] in q's dtype."""
    if meta.paths is not None:
        if len(meta.paths) == 1:
            return path_attend(q, k, v, cache, layer, meta.paths[0])
        # rows padded to the widest tree: each row attends with its own nodes; padding rows' outputs are zero
        out = q.new_zeros(q.shape)
        for b, pa in enumerate(meta.paths):
            n = pa.order.shape[0]
            out[b : b + 1, :n] = path_attend(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n],
                                             cache.rows(b, b + 1), layer, pa)
        return out
    keys, values = cache.update(layer, meta.start, k.transpose(1, 2), v.transpose(1, 2), meta.kv_len)
    if meta.lengths is not None:  # [B, 1, H, Dh]: each row over its own length, not all rows up to kv_len
        y = meta.kernel.decode_attention(q[:, 0].float().contiguous(), cache.k[layer], cache.v[layer],
                                         meta.lengths, q.shape[-1] ** -0.5)  # [B, H, Dh]
        return y[:, None].to(q.dtype)
    if keys.device.type == "cpu" and keys.dtype != torch.float32:  # a bf16 decode cache (decode_kv_dtype): torch's
        keys, values = keys.float(), values.float()  # CPU attention is several times faster in fp32, same values
    qt = q.transpose(1, 2).to(keys.dtype)  # [B, H, T, Dh]
    y = F.scaled_dot_product_attention(qt, keys, values, attn_mask=meta.mask, is_causal=meta.causal,
                                       enable_gqa=keys.shape[1] != qt.shape[1])
    return y.to(q.dtype).transpose(1, 2)  # cast first: for T = 1 the transpose is then free (a view)


def fused_path_attend(qkv: torch.Tensor, rope, cache: KVCache, layer: int, meta: AttnMeta) -> torch.Tensor | None:
    """Exact mode, one sequence, the compiled path kernel: qkv [1, N, H + 2 Hk, Dh] bf16 or float32 (the fused
    projection, before RoPE) -> [1, N, H, Dh] float32 through ``eyas/kernels/layer_ops.cpp`` (RoPE, cache write, q
    in float32: the bits of ``Rope.apply`` + ``path_attend``) and the path kernel. None where it does not serve
    (fast mode, batches, no kernel, another dtype, not on a CPU): the caller takes the op-by-op path.
    """
    paths = meta.paths
    if paths is None or len(paths) != 1 or paths[0].kernel is None or qkv.dtype not in (torch.bfloat16, torch.float32):
        return None
    if qkv.dtype == torch.float32 and cache.k.dtype != torch.float32:
        return None
    if qkv.device.type != "cpu" or qkv.shape[1] != paths[0].order.shape[0]:
        return None
    ops = _layer_ops()
    if ops is None:
        return None
    pa, n, dh = paths[0], qkv.shape[1], qkv.shape[-1]
    kc, vc = cache.k[layer, 0], cache.v[layer, 0]
    heads = qkv.shape[2] - 2 * kc.shape[0]
    cos, sin = rope.rows
    q = ops.rope_cache(qkv[0], cos, sin, kc, vc, pa.start, heads)  # [N, H, Dh] float32
    y = pa.kernel.path_attention(q, kc, vc, pa.start, pa.slots, pa.lengths, dh**-0.5)
    return y.view(1, n, heads, dh)


_layer_ops = kernels.LAYER_OPS


def path_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                paths: PathAttention) -> torch.Tensor:
    """Exact mode, one sequence: q [1, N, H, Dh]; k, v [1, N, Hk, Dh] for N tree nodes -> [1, N, H, Dh].

    ``cache`` is the sequence's own (1-row) cache.
    """
    start, kv_len = paths.start, paths.kv_len
    n, h, dh = q.shape[1], q.shape[2], q.shape[3]
    hk = k.shape[2]
    if paths.kernel is not None:  # the tree's entries go to slots start .. start + N; nodes read the shared cache
        cache.update(layer, start, k.transpose(1, 2), v.transpose(1, 2), start + n)
        y = paths.kernel.path_attention(q[0].float().contiguous(), cache.k[layer, 0], cache.v[layer, 0],
                                        start, paths.slots, paths.lengths, dh**-0.5)  # [N, H, Dh]
        return y.view(1, n, h, dh).to(q.dtype)
    if paths.mirror is None:  # a plain step: one row, the cache itself
        mk, mv = cache.k[layer], cache.v[layer]  # [1, Hk, S_max, Dh]
        mk[:, :, start : start + n] = k.transpose(1, 2)
        mv[:, :, start : start + n] = v.transpose(1, 2)
    else:
        mk, mv = paths.mirror.k[layer], paths.mirror.v[layer]  # [W, Hk, S_max, Dh], W >= N
        # the tree's own entries, in node order, for commit (slots start .. start + N of the cache)
        cache.update(layer, start, k.transpose(1, 2), v.transpose(1, 2), kv_len)
        # mirror row r, slot start + j <- node order[r, j]; zeros past r's path ([N, N, Hk, Dh] -> [N, Hk, N, Dh])
        keep = paths.keep[:, :, None, None]
        mk[:n, :, start : start + n] = torch.where(keep, k[0][paths.order], 0).transpose(1, 2)
        mv[:n, :, start : start + n] = torch.where(keep, v[0][paths.order], 0).transpose(1, 2)
    qr = q[0].reshape(n, hk, h // hk, dh).to(mk.dtype)  # [N, Hk, G, Dh]: the G query heads of a KV head
    scores = torch.matmul(qr, mk[:n, :, :kv_len].transpose(-1, -2)) * dh**-0.5  # [N, Hk, G, S]
    probs = scores.float().masked_fill(paths.hidden, float("-inf")).softmax(-1).to(mv.dtype)
    y = torch.matmul(probs, mv[:n, :, :kv_len])  # [N, Hk, G, Dh]
    return y.view(1, n, h, dh).to(q.dtype)
