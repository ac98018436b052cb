"""EAGLE-3 drafting heads (Li et al. 2025): fused multi-layer features, one
decoder layer that attends over [norm(embedding), norm(hidden)], and a reduced
draft vocabulary with its own ``lm_head``.

Parameter names follow the layout vLLM, SGLang and TensorRT-LLM load
(``LlamaForCausalLMEagle3``): ``fc`` (3H_target -> H, no bias), ``midlayer.*``
(q/k/v projections read 2H), ``norm``, ``lm_head`` [draft_vocab, H], ``d2t``
(draft id -> target id offset) and ``t2d`` (target id in the draft vocab). The
token embedding is the target's. Reading and writing that layout lives in
``eyas.formats.eagle3``.

Recurrence: step 0 at position t reads (embed(x[t+1]), fc(taps[t])); step k > 0
reads (embed(draft token), the previous step's pre-norm output). The pre-norm
output goes through ``norm`` and ``lm_head`` for draft logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from eyas.drafters.base import TargetFeatures, register_drafter
from eyas.drafters.eagle import EagleDrafter
from eyas.drafters.head_kernels import HeadPaths, fast_layer, fast_layer_ready
from eyas.drafters.head_step import HeadStep
from eyas.models.base import causal_mask
from eyas.models.config import ModelConfig
from eyas.models.layers import RopeTable, rms_norm
from eyas.models.native import MLP, Attention, DecoderLayer, RMSNorm, vocab_logits


def default_eagle3_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high taps: the residual entering layers (2, L // 2, L - 3).

    Clamped into 0 .. L - 1 for toy models with fewer than 5 layers.
    """
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass
class Eagle3Config:
    """The head's shape; ``model`` holds the decoder layers' hyper-parameters (``model.num_layers`` of them: the
    first reads [norm(embedding), norm(hidden)], any later one is a plain Llama layer over the hidden state).
    """

    model: ModelConfig
    draft_vocab_size: int
    # target layers whose input residual is fused (EAGLE-3: 2, L // 2, L - 3)
    aux_layers: tuple[int, ...] = field(default_factory=tuple)
    target_hidden_size: int = 0  # 0: same as model.hidden_size
    # residual around attention: hidden_norm(hidden) instead of the raw hidden (speculators' default)
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.target_hidden_size == 0:
            self.target_hidden_size = self.model.hidden_size
        self.aux_layers = tuple(int(i) for i in self.aux_layers)

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, draft_vocab_size: int | None = None,
                   aux_layers: tuple[int, ...] | None = None, num_layers: int = 1) -> Eagle3Config:
        # the engines' EAGLE-3 layer is a plain Llama layer whatever the target family (no q/k norm,
        # no q/k/v-only bias: vLLM/TensorRT-LLM/speculators read one attention_bias flag)
        plain = {"num_layers": num_layers, "model_type": "llama", "qkv_bias": False, "o_bias": False,
                 "qk_norm": False}
        model = ModelConfig(**{**target_cfg.__dict__, **plain})
        return cls(model=model, draft_vocab_size=draft_vocab_size or target_cfg.vocab_size,
                   aux_layers=aux_layers or default_eagle3_taps(target_cfg.num_layers),
                   target_hidden_size=target_cfg.hidden_size)


class Eagle3Layer(nn.Module):
    """``midlayer``: a Llama decoder layer whose attention reads [norm(emb), norm(hidden)] (2H)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = Attention(cfg)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * d, a.h * a.dh, bias=cfg.qkv_bias)
        a.k_proj = nn.Linear(2 * d, a.hk * a.dh, bias=cfg.qkv_bias)
        a.v_proj = nn.Linear(2 * d, a.hk * a.dh, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        """emb, hid: [B, T, H] -> [B, T, 2H]."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hid)], dim=-1)

    def finish(self, hid: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual around attention (the hidden input), then the MLP block -> pre-norm output."""
        x = (self.hidden_norm(hid) if self.norm_before_residual else hid) + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, emb, hid, rope, cache, start, mask, kv_len):
        a = self.self_attn(self.attn_input(emb, hid), rope, cache, 0, start, mask, kv_len)
        return self.finish(hid, a)

    def fast(self, emb, hid, rope_rows, cache, write_start: int, paths: HeadPaths) -> torch.Tensor:
        """``forward`` for a few rows on the compiled kernels (eyas.drafters.head_kernels): emb, hid [T, H]."""
        normed = rms_norm(hid, self.hidden_norm)
        attn_in = torch.cat([rms_norm(emb, self.input_layernorm), normed], dim=-1)
        residual = normed if self.norm_before_residual else hid
        return fast_layer(self.self_attn, self.mlp, self.post_attention_layernorm, attn_in, residual, rope_rows,
                          cache, write_start, paths)


class Eagle3Head(nn.Module):
    """fc over the target's taps, ``midlayer`` (EAGLE-3's layer), then ``extra_layers`` (plain Llama layers, none in
    a one-layer head; the engines name them ``layers.1.`` on: eyas.formats.eagle3), ``norm``, ``lm_head``.
    """

    # EAGLE-3 heads ship no embedding: the drafter embeds with the target's (EagleDrafter._embed)
    embed_tokens: nn.Module | None = None

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.config = cfg.model  # what EagleDrafter sizes its cache from
        h = cfg.model.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, h, bias=False)
        if cfg.model.num_layers < 1:
            raise ValueError(f"an EAGLE-3 head has at least one decoder layer, got num_layers {cfg.model.num_layers}")
        self.midlayer = Eagle3Layer(cfg.model, cfg.norm_before_residual)
        self.extra_layers = nn.ModuleList(DecoderLayer(cfg.model) for _ in range(cfg.model.num_layers - 1))
        self.norm = RMSNorm(h, cfg.model.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        vd, v = cfg.draft_vocab_size, cfg.model.vocab_size
        # identity mapping until a vocabulary is chosen (set_draft_vocab)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(v) < vd)
        # a plain attribute, not a buffer: .to(bfloat16) must not round the RoPE frequencies
        self.inv_freq = cfg.model.inv_freq()
        self.rope_table = RopeTable(self.inv_freq)  # cos / sin by position, computed once (not state)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids: [Vd] long, sorted ascending -> d2t offsets and t2d mask."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.shape[0] != self.cfg.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.shape[0]} ids, head expects {self.cfg.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.shape[0]))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """[Vd] long: the target id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [..., L, H_target] residuals at the aux layers -> [..., H]."""
        return self.fc(taps.flatten(-2).to(self.fc.weight.dtype))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm outputs -> [..., Vd] draft-vocabulary logits."""
        return vocab_logits(self.lm_head, self.norm(out))

    def fast_ready(self) -> bool:
        """Whether ``fast_forward`` serves (fused Q8_0 blocks, the compiled kernels: a bf16 or fp32 head on a CPU)."""
        return fast_layer_ready(self.midlayer.self_attn, self.midlayer.mlp) and all(
            fast_layer_ready(layer.self_attn, layer.mlp) for layer in self.extra_layers)

    def fast_forward(self, emb, hid, positions, cache, write_start: int, paths: HeadPaths) -> torch.Tensor:
        """emb, hid: [T, H]; positions [T]; rows attend as ``paths`` says -> [T, H] pre-norm (``forward``'s).
        cache: the head's, one cache layer per decoder layer.
        """
        rope = self.rope_table.rows(positions, emb.dtype, cache.max_slots)
        x = self.midlayer.fast(emb, hid.to(emb.dtype), rope, cache, write_start, paths)
        for i, layer in enumerate(self.extra_layers, start=1):
            x = fast_layer(layer.self_attn, layer.mlp, layer.post_attention_layernorm,
                           rms_norm(x, layer.input_layernorm), x, rope, cache, write_start, paths, layer=i)
        return x

    def forward(self, emb, hid, positions, cache, start: int, mask) -> torch.Tensor:
        """emb, hid: [B, T, H]; positions [B, T]; mask [B, T, S] bool or None -> [B, T, H] pre-norm."""
        rope = self.rope_table(positions, emb.dtype, cache.max_slots)
        t = emb.shape[1]
        attn_mask = None if mask is None else mask[:, None]
        if attn_mask is None and t > 1:
            attn_mask = causal_mask(t, start, device=emb.device)[None, None]
        x = self.midlayer(emb, hid.to(emb.dtype), rope, cache, start, attn_mask, start + t)
        for i, layer in enumerate(self.extra_layers, start=1):
            x = layer(x, rope, cache, i, start, attn_mask, start + t)
        return x


def random_eagle3_head(target_cfg: ModelConfig, draft_vocab_size: int | None = None, seed: int = 0,
                       dtype=torch.float32, num_layers: int = 1) -> Eagle3Head:
    """An untrained head (tests: a random head must still be lossless). Draft vocab: a random subset."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size, num_layers=num_layers)
    head = Eagle3Head(cfg)
    head.set_draft_vocab(torch.randperm(target_cfg.vocab_size, generator=g)[: cfg.draft_vocab_size])
    return head.to(dtype).eval().requires_grad_(False)


@register_drafter("eagle3")
class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 drafting with a static (choices) or dynamic (EAGLE-2) tree."""

    def __init__(self, target=None, path=None, head: Eagle3Head | None = None, tree: str | None = None,
                 target_model=None) -> None:
        tm = target_model if target_model is not None else target.model
        if head is None:
            if path is None:
                raise ValueError("the eagle3 drafter needs a head directory: --drafter PATH (by name alone it "
                                 "takes the target's shipped EAGLE-3 head, and this target has none)")
            from eyas.formats.eagle3 import load_eagle3

            head = load_eagle3(path, tm.config, tm.dtype)
        super().__init__(head=head, tree=tree, target_model=tm)
        self.taps = head.cfg.aux_layers
        if self.fast and self.head.embed_tokens is None:
            self.step = HeadStep.build(self.head, getattr(getattr(tm, "model", None), "embed_tokens", None))
        self.expansion.id_map = head.draft_ids().to(tm.device)

    def _native_taps(self, feats: TargetFeatures) -> list[torch.Tensor] | None:
        return [feats.taps[i] for i in self.taps] if self.step is not None and self.step.fuses else None

    def _feature_in(self, feats: TargetFeatures) -> torch.Tensor:
        return self.head.fuse(torch.stack([feats.taps[i] for i in self.taps], dim=-2))

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head.logits(h).float(), dim=-1)
