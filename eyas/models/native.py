"""A compact Llama-family transformer (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2).

gpt-fast-sized: one file, explicit KV cache, explicit positions and masks.
Parameter names follow transformers exactly (``model.layers.0.self_attn.q_proj``
...), so a Hugging Face state dict loads with no key mapping.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from eyas.kv.static import KVCache
from eyas.models.attention import KV_BLOCK, AttnMeta, attend, fused_path_attend, round_up
from eyas.models.base import ForwardMeta, ForwardOutput, PathAttention, TargetModel, causal_mask
from eyas.models.config import ModelConfig
from eyas.models.decode_plan import DecodePlan
from eyas.models.exact import DecodeFloors, RowFloor, linear
from eyas.models.layers import (  # noqa: F401  (re-exported: the heads build on these)
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    apply_rope,
    rms_norm,
    rope_table,
    rope_tables,
    vocab_logits,
)
from eyas.models.lm_screen import screened
from eyas.models.packed import pack_linears_
from eyas.models.quant import QUANTIZE_CHOICES, quantize_int8_


class Rope:
    """RoPE for one forward: ``apply`` rotates [B, T, N, Dh] with 3 ops (rotate-half convention).

    cos, sin_signed: [B, T, 1, Dh] in the model dtype; sin_signed carries rotate_half's minus sign
    (-sin on the first half), so x * cos + flip_halves(x) * sin_signed == x * cos + rotate_half(x) * sin.
    """

    def __init__(self, table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> None:
        cs = table[positions].to(dtype)  # [B, T, 2, Dh]
        self.cos, self.sin_signed = cs[:, :, :1], cs[:, :, 1:]

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) as contiguous [B * T, Dh] (the compiled layer step's layout), made once a forward."""
        dh = self.cos.shape[-1]
        return self.cos.reshape(-1, dh).contiguous(), self.sin_signed.reshape(-1, dh).contiguous()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, N, Dh] -> rotated, contiguous."""
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
        return torch.addcmul(x * self.cos, swapped, self.sin_signed)


class TargetAttention(nn.Module):
    """Self-attention with one fused ``qkv_proj`` (rows: q, then k, then v), as vLLM and gpt-fast run it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.h, self.hk, self.dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(d, (self.h + 2 * self.hk) * self.dh, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.dh, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.dh, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope: Rope, cache: KVCache, layer: int, meta: AttnMeta, floors) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        b, t, _ = x.shape
        h, hk = self.h, self.hk
        qkv = linear(self.qkv_proj, x, floors).view(b, t, h + 2 * hk, self.dh)
        if self.q_norm is None:
            y = fused_path_attend(qkv, rope, cache, layer, meta)
            if y is not None:  # exact mode's decode / verify forward: RoPE, cache write and attention in 2 calls
                return linear(self.o_proj, y.to(x.dtype).view(b, t, h * self.dh), floors)
        qk = qkv[:, :, : h + hk]
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            qk = torch.cat([rms_norm(qk[:, :, :h], self.q_norm), rms_norm(qk[:, :, h:], self.k_norm)], dim=2)
        qk = rope.apply(qk)  # [B, T, H + Hk, Dh]
        y = attend(qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + hk :], cache, layer, meta)  # [B, T, H, Dh]
        return linear(self.o_proj, y.reshape(b, t, h * self.dh), floors)


class TargetMLP(nn.Module):
    """SwiGLU with one fused ``gate_up_proj`` (rows: gate, then up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, floors) -> torch.Tensor:
        gate, up = linear(self.gate_up_proj, x, floors).chunk(2, dim=-1)
        return linear(self.down_proj, F.silu(gate) * up, floors)


class TargetLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = TargetAttention(cfg)
        self.mlp = TargetMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope: Rope, cache: KVCache, layer: int, meta: AttnMeta, floors) -> torch.Tensor:
        x = x + self.self_attn(rms_norm(x, self.input_layernorm), rope, cache, layer, meta, floors)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm), floors)


# fused name -> the Hugging Face projections concatenated into it, in row order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names (q/k/v_proj, gate/up_proj) -> fused names (qkv_proj, gate_up_proj).

    Example: model.layers.0.self_attn.{q,k,v}_proj.weight -> model.layers.0.self_attn.qkv_proj.weight.
    Keys that are already fused pass through, so fused checkpoints load as well.
    """
    out = dict(sd)
    for fused, parts in FUSED.items():
        for key in [k for k in sd if f".{parts[0]}." in k]:
            head, kind = key.split(f".{parts[0]}.")
            names = [f"{head}.{p}.{kind}" for p in parts]
            if all(n in out for n in names):
                out[f"{head}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def _embedding(n: int, d: int) -> nn.Embedding:
    """nn.Embedding(n, d), whose weight a meta-device build (a checkpoint's load) leaves uninitialised: torch's
    normal_ on meta tensors imports torch._dynamo, ~1 s of every load.
    """
    w = torch.empty(n, d)
    if w.device.type != "meta":
        nn.init.normal_(w)
    return nn.Embedding(n, d, _weight=w)


class LlamaBody(nn.Module):
    """``model.*`` in transformers naming (projections fused)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NativeLlama(nn.Module, TargetModel):
    """The fast target backend: fused projections, fp32 KV cache for bf16 on CPU, 3-op RoPE."""

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
        self._rope = torch.empty(0, 2, cfg.head_dim)  # [P, 2, Dh] fp32 cos / signed sin, grown on demand
        self.row_floors = RowFloor()
        pack_linears_(self)  # bf16 CPU inference on oneDNN-prepacked weights: same bits, 2-4x faster GEMVs

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head_proj.weight = self.model.embed_tokens.weight

    # transformers calls the output projection ``lm_head``; keep that key in state dicts
    def _remap(self, sd: dict) -> dict:
        return {("lm_head_proj." + k[8:] if k.startswith("lm_head.") else k): v for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict, assign: bool = False) -> None:
        """A Hugging Face state dict (separate or already fused projections); fused here. assign: take the tensors
        as the parameters (a meta-device build) instead of copying into them.
        """
        sd = fuse_hf_state_dict(self._remap(sd))
        if self.config.tie_word_embeddings:
            sd.pop("lm_head_proj.weight", None)
        missing, unexpected = self.load_state_dict(sd, strict=False, assign=assign)
        self.tie_weights()  # to_empty() and assign untie shared parameters
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

    @property
    def kv_dtype(self) -> torch.dtype:
        """float32 for a 16-bit model on a CPU (torch's CPU attention is several times faster in fp32), else dtype."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def path_kernel(self):
        """The compiled attention (eyas.kernels: exact mode's trees, batched decode over per-row lengths) where it
        serves this model: CPU, fp32 cache, a supported head shape. Built on first use; None elsewhere (trees then
        attend through mirrors, batched decode through torch's fused attention under a mask).
        """
        if not hasattr(self, "_path_kernel"):
            from eyas import kernels

            c = self.config
            mod = None
            if self.device.type == "cpu" and self.kv_dtype == torch.float32:
                mod = kernels.path_attention()
                if mod is not None and not mod.supports(c.num_heads // c.num_kv_heads, c.head_dim):
                    mod = None
            self._path_kernel = mod
        return self._path_kernel

    def decode_plan(self) -> DecodePlan | None:
        """The layers' kernel calls gathered once for exact-mode forwards of one sequence (eyas.models.decode_plan),
        made at the first forward (the blocks are attached at load); None where some piece is not a compiled kernel.
        """
        if "_decode_plan" not in self.__dict__:
            self.__dict__["_decode_plan"] = DecodePlan.build(self)
        return self.__dict__["_decode_plan"]

    def new_cache(self, batch: int, max_slots: int, dtype: torch.dtype | None = None) -> KVCache:
        """``dtype``: the cache's, default ``kv_dtype`` (``decode_kv_dtype`` for batched one-token decoding)."""
        c = self.config
        slots = round_up(max_slots)  # exact mode attends multiples of KV_BLOCK keys
        return KVCache.empty(c.num_layers, batch, c.num_kv_heads, slots, c.head_dim, dtype or self.kv_dtype,
                             self.device)

    def decode_kv_dtype(self) -> torch.dtype:
        """The cache dtype for batched one-token decoding (``ForwardMeta.row_lengths``, eyas data): bf16 for a bf16
        model where the compiled decode kernel reads it (AVX-512), which halves the bytes attention streams; the
        values are the same (a bf16 model's keys and values are bf16 before they are cached). Else ``kv_dtype``.
        """
        k = self.path_kernel()
        if self.dtype == torch.bfloat16 and k is not None and hasattr(k, "decode_bf16") and k.decode_bf16():
            return torch.bfloat16
        return self.kv_dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.lm_head_proj, nn.Linear):  # int8 (eyas.models.quant)
            return self.lm_head_proj(hidden)
        return vocab_logits(self.lm_head_proj, hidden)

    def prepare_exact(self) -> dict[str, int]:
        """Probe every projection's row floor now (about a second) rather than inside the first exact forward."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear) or hasattr(mod, "scales"):
                self.row_floors(mod)
        return self.row_floors.table()

    def quantize_(self, mode: str) -> None:
        """``int8``: weight-only int8 projections (eyas.models.quant); changes the model's outputs."""
        if mode not in QUANTIZE_CHOICES:
            raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
        if mode == "int8":
            quantize_int8_(self)
            self.__dict__.pop("_decode_plan", None)  # its projections are gone
            self.row_floors = RowFloor()

    def rope(self, positions: torch.Tensor, slots: int) -> Rope:
        """positions: [B, T] long, all < slots."""
        if self._rope.shape[0] < slots or self._rope.device != self.device:
            self._rope = rope_table(self.inv_freq.to(self.device), max(slots, 2 * self._rope.shape[0]))
        return Rope(self._rope, positions, self.dtype)

    forward = TargetModel.forward  # the keyword form (nn.Module's forward placeholder would shadow it)

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: ForwardMeta) -> ForwardOutput:
        attn = self._attn_meta(tokens, cache, meta)
        # exact mode: decode / verification forwards (paths) may run on row-invariant kernels unpadded; prefill pads
        floors = self.row_floors if meta.exact else DecodeFloors(self.row_floors) if attn.paths is not None else None
        rope = self.rope(positions, cache.max_slots)
        x = self.embed(tokens)
        plan = self.decode_plan()
        if plan is not None and plan.serves(tokens, attn, exact_prefill=meta.exact):  # the same calls, leaner
            x, tapped = plan.run(x, rope, cache, attn.paths[0], meta.taps)
        else:
            tapped = {}
            for i, layer in enumerate(self.model.layers):
                if i in meta.taps:
                    tapped[i] = x
                x = layer(x, rope, cache, i, attn, floors)
        hidden = rms_norm(x, self.model.norm)
        rows = hidden if meta.logits_idx is None else hidden[:, meta.logits_idx]
        if meta.exact and meta.logits_idx is not None:
            # exact prefill's few logit rows (the last token's) are no part of the cache: the row-invariant block
            # kernel, as decoding's, gives them the same bits in any chunking, without padding a [V, H] GEMM
            floors = DecodeFloors(self.row_floors)
        # greedy callers read only the argmax: where the block kernel computes the logits, a screen finds the few
        # that can be it and computes those alone, the same bits (eyas.models.lm_screen)
        screen = meta.argmax_only and type(floors) is DecodeFloors
        found = screened(self.lm_head_proj, rows) if screen else None
        if found is not None:
            return ForwardOutput(logits=found.logits, hidden=hidden, taps=tapped, greedy=found.greedy)
        logits = linear(self.lm_head_proj, rows, floors) if floors is not None else self.lm_head(rows)
        return ForwardOutput(logits=logits.float(), hidden=hidden, taps=tapped)

    def _attn_meta(self, tokens: torch.Tensor, cache: KVCache, meta: ForwardMeta) -> AttnMeta:
        """What every layer's attention reads: the mask built once, or the per-row paths checked once."""
        b, t = tokens.shape
        start, mask, kv_len, paths = meta.start, meta.mask, meta.kv_len, meta.paths
        if paths is not None:
            if len(paths) != b:
                raise ValueError(f"path attention (exact mode) needs one PathAttention per batch row: {len(paths)} "
                                 f"for a batch of {b}")
            for b, pa in enumerate(paths):
                s = pa.kv_len
                if s % KV_BLOCK or s > cache.rows(b, b + 1).max_slots or pa.order.shape[0] > t:
                    raise ValueError(f"path attention needs kv_len a multiple of {KV_BLOCK} within the cache and at "
                                     f"most {t} nodes, got kv_len {s}, {pa.order.shape[0]} nodes")
            return AttnMeta(start=start, kv_len=max(pa.kv_len for pa in paths), paths=paths)
        if meta.exact and mask is None and b == 1 and isinstance(start, int) and self.path_kernel() is not None:
            pa = causal_paths(start, t, self.path_kernel())
            return AttnMeta(start=start, kv_len=pa.kv_len, paths=[pa])
        kv_len = kv_len if kv_len is not None else start + t
        if meta.row_lengths is not None and t == 1 and self.path_kernel() is not None:
            return AttnMeta(start=start, kv_len=kv_len, lengths=meta.row_lengths, kernel=self.path_kernel())
        if meta.causal and mask is None and t > 1 and kv_len == t and isinstance(start, int) and start == 0:
            return AttnMeta(start=0, kv_len=t, causal=True)
        if mask is None and (t > 1 or kv_len != start + t):
            mask = causal_mask(t, start, kv_len, tokens.device).expand(b, t, kv_len)
        return AttnMeta(start=start, kv_len=kv_len, mask=None if mask is None else mask[:, None])

    def commit(self, cache: KVCache, start: int, src: torch.Tensor) -> None:
        cache.commit(start, src)


def causal_paths(start: int, t: int, kernel) -> PathAttention:
    """Exact-mode prefill of ``t`` prompt tokens after ``start`` cached slots as path attention: row i attends
    slots 0 .. start + i in order, through the compiled kernel, whose bits for a row depend only on the keys it
    attends and their order. A prompt token's attention is then computed as a decoded token's is, the same
    whatever the chunking, with no key padding (torch's flash attention needed keys padded to 512 for that).
    """
    order = torch.arange(t).expand(t, t)
    pa = PathAttention(order=order, lengths=torch.arange(1, t + 1), start=start, kv_len=round_up(start + t),
                       mirror=None, kernel=kernel)
    pa.__dict__["slots"] = order + start  # the cached property, set without a copy of the order
    return pa
