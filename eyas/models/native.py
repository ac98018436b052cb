"""A compact Llama-family transformer (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2).

gpt-fast-sized: one file, explicit KV cache, explicit positions and masks.
Parameter names follow transformers exactly (``model.layers.0.self_attn.q_proj``
...), so a Hugging Face state dict loads with no key mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.kv.static import KVCache
from eyas.models.base import ForwardOutput, PathAttention, TargetModel, causal_mask
from eyas.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 like transformers, then cast back
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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
    if not fast or w.requires_grad or m > 64:
        return proj(x)
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

    def forward(self, x, rope, cache: KVCache, layer: int, start: int, mask, kv_len: int, paths=None):
        """x: [B, T, D]; rope: (cos, sin) [B, 1, T, Dh]; mask: [B, 1, T, S] bool or None."""
        b, t, _ = x.shape
        q, k, v = self.project(x, rope)
        keys, values = cache.update(layer, start, k, v, kv_len)  # [B, Hk, S, Dh]
        if paths is not None:
            y = self._path_attention(q, k, v, layer, start, paths)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.hk != self.h)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.dh))

    def _path_attention(self, q, k, v, layer: int, start: int, paths: PathAttention) -> torch.Tensor:
        """Every query row over its own mirror row: prefix + its path in consecutive slots.

        q: [1, H, W, Dh]; k, v: [1, Hk, W, Dh] the new entries. Returns [1, H, W, Dh]. The G = H / Hk
        query heads sharing a KV head ride as G query rows, so no KV head is repeated. Written as
        matmul + softmax rather than torch's fused CPU kernel: that one splits work across threads
        so that a row's rounding depends on which other rows share the call (measured), whereas
        here every (row, KV head) is its own small GEMM and its own softmax rows.
        """
        w, g, kv_len = q.shape[2], self.h // self.hk, paths.masks.shape[-1]
        mk, mv = paths.mirror.k[layer], paths.mirror.v[layer]  # [W, Hk, S_max, Dh]
        if mk.shape[0] != w:
            raise ValueError(f"path attention: {w} query rows but a mirror of {mk.shape[0]} rows")
        # row r, slot start + j <- node order[r, j] ([Hk, W, W, Dh] -> [W, Hk, W, Dh]), zeros past the path
        keep = paths.keep[None, :, :, None]
        mk[:, :, start : start + w] = torch.where(keep, k[0][:, paths.order], 0).transpose(0, 1)
        mv[:, :, start : start + w] = torch.where(keep, v[0][:, paths.order], 0).transpose(0, 1)
        qr = q[0].view(self.hk, g, w, self.dh).permute(2, 0, 1, 3)  # [W, Hk, G, Dh]
        scores = torch.matmul(qr, mk[:, :, :kv_len].transpose(-1, -2)).float() * self.dh**-0.5  # [W, Hk, G, S]
        probs = scores.masked_fill(paths.hidden, float("-inf")).softmax(-1).to(q.dtype)
        y = torch.matmul(probs, mv[:, :, :kv_len])  # [W, Hk, G, Dh]
        return y.permute(1, 2, 0, 3).reshape(1, self.h, w, self.dh)


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

    def forward(self, x, rope, cache, layer, start, mask, kv_len, paths=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer, start, mask, kv_len, paths)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """``model.*`` in transformers naming."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NativeLlama(nn.Module, TargetModel):
    """The fast target backend."""

    row_starts = True
    path_attention = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head_proj = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # a plain attribute, not a buffer: .to(bfloat16) must not round the RoPE frequencies
        self.inv_freq = cfg.inv_freq()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head_proj.weight = self.model.embed_tokens.weight

    # transformers calls the output projection ``lm_head``; keep that key in state dicts
    def _remap(self, sd: dict) -> dict:
        return {("lm_head_proj." + k[8:] if k.startswith("lm_head.") else k): v for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict) -> None:
        sd = self._remap(sd)
        if self.config.tie_word_embeddings:
            sd.pop("lm_head_proj.weight", None)
        missing, unexpected = self.load_state_dict(sd, strict=False)
        self.tie_weights()  # to_empty() unties shared parameters
        missing = [m for m in missing if not (self.config.tie_word_embeddings and m == "lm_head_proj.weight")]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, max_slots: int) -> KVCache:
        c = self.config
        return KVCache.empty(c.num_layers, batch, c.num_kv_heads, max_slots, c.head_dim, self.dtype, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(self.lm_head_proj, hidden)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq, positions, self.dtype)

    @torch.inference_mode()
    def forward(
        self, tokens, positions, cache, start, mask=None, taps=(), logits_idx=None, kv_len=None, paths=None
    ):
        b, t = tokens.shape
        kv_len = kv_len if kv_len is not None else start + t
        if paths is not None:
            if b != 1 or not isinstance(start, int):
                raise ValueError("path attention (exact mode) runs a batch of one")
            mask = None  # each row's mask is in paths
        elif mask is None and (t > 1 or kv_len != start + t):
            mask = causal_mask(t, start, kv_len, tokens.device).expand(b, t, kv_len)
        attn_mask = None if mask is None else mask[:, None]  # [B, 1, T, S]
        rope = self.rope(positions)
        x = self.embed(tokens)
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            if i in taps:
                tapped[i] = x
            x = layer(x, rope, cache, i, start, attn_mask, kv_len, paths)
        hidden = self.model.norm(x)
        rows = hidden if logits_idx is None else hidden[:, logits_idx]
        return ForwardOutput(logits=self.lm_head(rows).float(), hidden=hidden, taps=tapped)

    def commit(self, cache: KVCache, start: int, src: torch.Tensor) -> None:
        cache.commit(start, src)
