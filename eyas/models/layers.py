"""Llama-family building blocks in Hugging Face naming: RMSNorm, RoPE, attention, MLP, decoder layer.

The EAGLE heads and their training use these modules (separate q/k/v and gate/up projections,
parameter names as in transformers). The native target has its own fused layer
(eyas.models.native.TargetLayer) and fuses Hugging Face checkpoints at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models.config import ModelConfig
from eyas.models.packed import PackedLinear, skinny_kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # inference (the heads' drafting): one compiled pass where it serves
            return rms_norm(x, self)
        # training: computed in float32 like transformers, then cast back
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """One fused kernel: statistics and scaling in fp32, one rounding to x's dtype at the end.

    Numerics policy: transformers rounds the normalised activations to the model dtype before
    multiplying by the weight (two roundings); this rounds once. The difference is within bf16
    rounding (tests/models/test_native.py compares logits with transformers at stated tolerances).
    CPU inference takes the compiled one-pass kernel (eyas/kernels/rms_norm.cpp, row-invariant: ~1 us a
    row against ~19 us for torch's decomposed op); anything else ``F.rms_norm``.
    """
    w = norm.weight
    if x.device.type == "cpu" and x.dtype == w.dtype and x.dtype in _NORM_DTYPES and not torch.is_grad_enabled():
        kernel = _norm_kernel()
        if kernel is not None:
            return kernel.rms_norm(x, w, norm.eps)
    return F.rms_norm(x, w.shape, w, norm.eps)


_NORM_DTYPES = (torch.bfloat16, torch.float32)
_norm_kernel = kernels.Lazy(kernels.rms_norm)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, Dh]; cos, sin: [B, 1, T, Dh] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """inv_freq [Dh/2], positions [B, T] -> cos, sin [B, 1, T, Dh] in ``dtype``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(inv_freq: torch.Tensor, n: int) -> torch.Tensor:
    """[n, 2, Dh] float32: cos and signed sin (rotate_half's minus on the first half) for positions 0 .. n - 1,
    computed in fp32 as transformers does: the target's table (eyas.models.native) and the heads' ``RopeTable``.
    """
    freqs = torch.arange(n, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq  # [n, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]
    return torch.stack([emb.cos(), sin], dim=1)


class RopeTable:
    """``rope_tables`` for a drafting head from ``rope_table`` computed once (fp32, grown on demand): two index
    ops a call instead of building the angles, cos and sin every tree level.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.shape[0])
        self._signed = self.sin  # sin with its first half negated (``rows``)

    def _grow(self, slots: int, device: torch.device) -> None:
        if self.cos.shape[0] < slots or self.cos.device != device:
            table = rope_table(self.inv_freq.to(device), max(slots, 2 * self.cos.shape[0]))
            self.cos, self._signed = table[:, 0].contiguous(), table[:, 1].contiguous()
            half = self._signed.shape[-1] // 2
            self.sin = torch.cat([-self._signed[:, :half], self._signed[:, half:]], dim=-1)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype, slots: int):
        """positions [B, T], all < slots -> cos, sin [B, 1, T, Dh] in ``dtype``."""
        self._grow(slots, positions.device)
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)

    def tables(self, slots: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [S >= slots, Dh] float32 for positions 0 .. S - 1 (what ``rows`` indexes)."""
        self._grow(slots, device)
        return self.cos, self._signed

    def rows(self, positions: torch.Tensor, dtype: torch.dtype, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], all < slots -> (cos, signed sin) [T, Dh] in ``dtype``, contiguous: the layout of the
        compiled RoPE (eyas/kernels/layer_ops.cpp; the signed sin carries rotate_half's minus on its first half).
        """
        cos, sin = self.tables(slots, positions.device)
        return cos[positions].to(dtype), sin[positions].to(dtype)


def vocab_logits(proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> [..., V] = proj(x), with the fastest GEMM shape for a frozen fp32 CPU projection.

    A vocabulary projection over a few rows is bound by streaming the [V, H] weight. On CPU in
    float32 (measured on the project's AVX2 VM, 2 threads, V = 49152, H = 576) ``F.linear``
    reaches 4-9 GB/s at 1-16 rows: 12.7 ms at 1 row, 30 ms at 9. A transposed copy makes the
    1-row product a GEMV at twice the speed (6.4 ms), and ``W @ x.T`` (the weight as the tall
    operand) runs 4-16 rows at 11-22 ms. Same dot products, other accumulation order (float
    rounding only). Anything else (GPU, bf16, training, many rows) takes ``F.linear``.
    """
    w = proj.weight
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    fast = w.device.type == "cpu" and w.dtype == torch.float32 and proj.bias is None
    if not fast or w.requires_grad or m > 64 or (isinstance(proj, PackedLinear) and skinny_kernel(w, rows)):
        return proj(x)  # eyas.models.packed: the streaming kernel where it serves (faster than both below)
    if m == 1:
        wt = getattr(proj, "_eyas_wt", None)
        key = (w.data_ptr(), w._version)
        if wt is None or wt[0] != key:
            wt = (key, w.detach().t().contiguous())  # [H, V], made once per weight version
            proj._eyas_wt = wt
        out = rows @ wt[1]
    else:
        out = torch.mm(w, rows.t()).t()
    return out.reshape(*x.shape[:-1], w.shape[0])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, h, hk, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.hk, self.dh = h, hk, dh
        self.q_proj = nn.Linear(d, h * dh, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, hk * dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, hk * dh, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, D_in] -> q [B, H, T, Dh], k, v [B, Hk, T, Dh] (q/k normed when qk_norm, RoPE applied)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.dh)
        k = self.k_proj(x).view(b, t, self.hk, self.dh)
        v = self.v_proj(x).view(b, t, self.hk, self.dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def forward(self, x, rope, cache: KVCache, layer: int, start: int, mask, kv_len: int) -> torch.Tensor:
        """x: [B, T, D]; rope: (cos, sin) [B, 1, T, Dh]; mask: [B, 1, T, S] bool or None (the heads' path)."""
        b, t, _ = x.shape
        q, k, v = self.project(x, rope)
        keys, values = cache.update(layer, start, k, v, kv_len)  # [B, Hk, S, Dh]
        # computed in the cache's dtype (fp32 for a bf16 head on a CPU: eyas.drafters.eagle.head_cache_dtype)
        y = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=self.hk != self.h)
        return self.o_proj(y.to(x.dtype).transpose(1, 2).reshape(b, t, self.h * self.dh))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, cache, layer, start, mask, kv_len):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer, start, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))
