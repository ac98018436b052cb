"""EAGLE drafting heads (Li et al. 2024): one decoder layer that predicts the
target's next feature from [token embedding, current feature].

EAGLE-1 reference layout (SafeAILab/EAGLE ``cnets.py``): ``fc`` maps 2D -> D
(bias per config ``bias``), ``layers.0`` is a Llama decoder layer whose input
norm is skipped, optional ``embed_tokens.weight``; logits come from the target's
``lm_head``. The head's own KV cache uses slot = target position of the feature.
EAGLE-3 (fused multi-layer features, reduced draft vocabulary) plugs in through
``taps``, ``fuse`` and ``d2t``; its training and layout arrive with training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.drafters.base import Drafter, TargetFeatures, register_drafter
from eyas.drafters.expansion import DynamicExpansion, Feed, make_expansion
from eyas.drafters.head_kernels import HeadPaths, fast_layer, fast_layer_ready, fuse_head_blocks_
from eyas.drafters.head_step import HeadOut, HeadStep
from eyas.formats import read_weights, weight_keys
from eyas.kv.static import KVCache
from eyas.models import gguf_tuning
from eyas.models.base import causal_mask
from eyas.models.config import ModelConfig
from eyas.models.gguf_blocks import FAST_ROWS, quantize_head_
from eyas.models.layers import RopeTable
from eyas.models.native import DecoderLayer
from eyas.models.packed import pack_linears_
from eyas.tree import Frontier
from eyas.types import DraftOutput, SamplingParams


class HeadMismatchError(ValueError):
    """The head was trained for a different target."""


class EagleHead(nn.Module):
    """fc([embed(token), feature]) -> one decoder layer (no input norm) -> predicted feature."""

    def __init__(self, cfg: ModelConfig, bias: bool = True, with_embedding: bool = False) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=bias)
        layer = DecoderLayer(cfg)
        layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 skips its input norm
        self.layers = nn.ModuleList([layer])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d) if with_embedding else None
        # a plain attribute, not a buffer: .to(bfloat16) must not round the RoPE frequencies
        self.inv_freq = cfg.inv_freq()
        self.rope_table = RopeTable(self.inv_freq)  # cos / sin by position, computed once (not state)

    def fast_ready(self) -> bool:
        """Whether ``fast_forward`` serves (fused Q8_0 blocks, the compiled kernels: a bf16 or fp32 head on a CPU)."""
        layer = self.layers[0]
        return isinstance(layer.input_layernorm, nn.Identity) and fast_layer_ready(layer.self_attn, layer.mlp)

    def fast_forward(self, emb, feats, positions, cache: KVCache, write_start: int, paths: HeadPaths) -> torch.Tensor:
        """emb, feats: [T, D]; positions [T]; rows attend as ``paths`` says -> [T, D] (``forward``'s)."""
        x = self.fc(torch.cat([emb, feats.to(emb.dtype)], dim=-1))
        rope = self.rope_table.rows(positions, x.dtype, cache.max_slots)
        layer = self.layers[0]
        return fast_layer(layer.self_attn, layer.mlp, layer.post_attention_layernorm, x, x, rope, cache, write_start,
                          paths)

    def forward(self, emb, feats, positions, cache: KVCache, start: int, mask) -> torch.Tensor:
        """emb, feats: [B, T, D]; positions [B, T]; mask [B, T, S] bool or None -> [B, T, D]."""
        x = self.fc(torch.cat([emb, feats.to(emb.dtype)], dim=-1))
        rope = self.rope_table(positions, x.dtype, cache.max_slots)
        t = x.shape[1]
        attn_mask = None if mask is None else mask[:, None]
        if attn_mask is None and t > 1:
            attn_mask = causal_mask(t, start, device=x.device)[None, None]
        return self.layers[0](x, rope, cache, 0, start, attn_mask, start + t)


def head_config_from_json(cfg: dict) -> tuple[ModelConfig, bool]:
    """EAGLE config.json (a LlamaConfig plus ``bias``) -> (ModelConfig with 1 layer, fc bias)."""
    c = dict(cfg)
    c["num_hidden_layers"] = 1
    c.setdefault("model_type", "llama")
    if c["model_type"] not in ("llama", "mistral", "qwen2", "qwen3"):
        c["model_type"] = "llama"
    return ModelConfig.from_hf(c), bool(cfg.get("bias", True))


def looks_like_eagle_dir(p: Path) -> bool:
    keys = weight_keys(p)  # key names only, no tensor reads
    return "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys)


def load_eagle_head(p: Path, target_cfg: ModelConfig, dtype: torch.dtype) -> EagleHead:
    """Load a reference-layout head and check it fits the target."""
    cfg, bias = head_config_from_json(json.loads((p / "config.json").read_text()))
    sd = read_weights(p)
    fc = sd.get("fc.weight")
    if fc is None:
        raise HeadMismatchError(f"{p} is not an EAGLE head: no fc.weight")
    if fc.shape[0] != target_cfg.hidden_size or fc.shape[1] != 2 * target_cfg.hidden_size:
        raise HeadMismatchError(
            f"EAGLE head {p} has hidden size {fc.shape[0]} (fc {tuple(fc.shape)}) but the target's hidden "
            f"size is {target_cfg.hidden_size}: this head was trained for a different target model"
        )
    if bias != ("fc.bias" in sd):
        state = "missing" if bias else "present"
        raise HeadMismatchError(f"EAGLE head {p}: config says bias={bias} but fc.bias is {state}")
    head = EagleHead(cfg, bias=bias, with_embedding="embed_tokens.weight" in sd)
    try:
        missing, unexpected = head.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise HeadMismatchError(f"EAGLE head {p}: config.json does not match the weights: {e}") from None
    if missing or unexpected:
        raise HeadMismatchError(f"EAGLE head {p}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return head.to(dtype).eval().requires_grad_(False)


@dataclass
class _HeadState:
    cache: KVCache
    n: int  # committed head slots (= target positions with features)
    root: HeadOut | None  # the head's call at the last committed slot: its output and its children's log-probs


@register_drafter("eagle")
class EagleDrafter(Drafter):
    """EAGLE-1/2 drafting with a static (choices) or dynamic (EAGLE-2) tree."""

    def __init__(self, target=None, path: Path | None = None, head: EagleHead | None = None,
                 tree: str | None = None, target_model=None) -> None:
        self.target = target_model if target_model is not None else target.model
        if head is None:
            if path is None:
                raise ValueError("the eagle drafter needs a head directory: --drafter PATH (by name alone it "
                                 "takes the target's shipped EAGLE-1 head, and this target has none)")
            head = load_eagle_head(Path(path), self.target.config, self.target.dtype)
        self.head = head.to(head_compute_dtype(self.target))
        pack_linears_(self.head)  # oneDNN-prepacked weights on a CPU (bf16; float32 past a few rows)
        # on a CPU (bf16 with AVX512-BF16, or float32): Q8_0 weights, a half (a quarter) of the bytes a step
        if quantize_head_(self.head) and self.head_dtype == torch.bfloat16:
            gguf_tuning.tune_once(self.head)  # the bf16 kernel's options for this CPU, if the target's did not set them
        fuse_head_blocks_(self.head)  # and q|k|v, gate|up as one block matrix each (eyas.drafters.head_kernels)
        self.fast = bool(getattr(self.head, "fast_ready", lambda: False)())
        self.step: HeadStep | None = None  # the head's call as one native call (EAGLE-3: Eagle3Drafter sets it)
        self.expansion = make_expansion(tree)
        self.max_nodes = self.expansion.max_nodes

    def start(self, max_slots: int) -> None:
        c = self.head.config
        cache = KVCache.empty(c.num_layers, 1, c.num_kv_heads, max_slots + self.expansion.max_fed + 1, c.head_dim,
                              head_cache_dtype(self.head_dtype, self.target.device), self.target.device)
        self.state = _HeadState(cache=cache, n=0, root=None)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.head.embed_tokens if self.head.embed_tokens is not None else self.target.embed
        return emb(tokens).to(self.head_dtype)

    @property
    def head_dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        """[..., D] head outputs -> [..., V] draft log-probs (over the expansion's vocabulary)."""
        return torch.log_softmax(self.target.lm_head(h.to(self.target.dtype)).float(), dim=-1)

    def _feature_in(self, feats: TargetFeatures) -> torch.Tensor:
        """Committed positions' target features -> [M, D] head input (EAGLE-1: the final feature)."""
        return feats.hidden.to(self.head_dtype)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, feats: TargetFeatures) -> None:
        s = self.state
        m = tokens.shape[0]
        if self.fast and m <= FAST_ROWS:  # a step's accepted tokens (prompts take the batched torch path)
            taps = self._native_taps(feats)
            out = self._fast_call(tokens.tolist(), None if taps else self._feature_in(feats), None, s.n, 1, s.n, s.n,
                                  [list(range(i + 1)) for i in range(m)], m - 1, taps)
        else:
            pos = torch.arange(s.n, s.n + m, device=tokens.device)
            h = self.head(self._embed(tokens[None]), self._feature_in(feats)[None], pos[None], s.cache, s.n, None)[0]
            out = HeadOut(h, self._logp(h[-1:]))
        s.n += m
        s.root = out.last()

    @torch.inference_mode()
    def propose(self, history: torch.Tensor, sampling: SamplingParams, generator=None) -> DraftOutput:
        self.draft_candidates(history)
        return DraftOutput(tree=self.expansion.finish().to(history.device))

    @torch.inference_mode()
    def draft_candidates(self, history: torch.Tensor) -> None:
        """Grow this step's candidates level by level into the expansion's books (``propose`` keeps the best of
        them as the tree; the hybrid drafter merges the books with lookup's chains instead).
        """
        s = self.state
        feed = self._next_feed(s.root, history[-1].cpu())
        parent_h = s.root.hidden  # [1, D]
        fed = 0
        while feed is not None:
            out = self._run_feed(feed, parent_h, fed)
            fed += out.hidden.shape[0]
            parent_h = out.hidden
            feed = self._next_feed(out)

    def _next_feed(self, out: HeadOut, root: torch.Tensor | None = None) -> Feed | Frontier | None:
        """The expansion's next level from a head call's results: from the call's top-k where it made them (the native
        call), else from its log-probs. ``root`` (the root's token): the first level, from ``out``'s one row.
        """
        if root is None:
            return self.expansion.grow_top(*out.top) if out.top is not None else self.expansion.grow(out.logp)
        if out.top is not None:
            return self.expansion.start_top(root, out.top[0][0], out.top[1][0])
        return self.expansion.start(root, out.logp[0])

    def _run_feed(self, feed: Feed | Frontier, parent_h: torch.Tensor, fed: int) -> HeadOut:
        """Run the head on one tree level (parent_h [P, D]: the previous level's outputs)."""
        s = self.state
        seen = feed.seen
        f, dev = len(seen), parent_h.device
        if self.fast and f <= FAST_ROWS:
            return self._fast_call(feed.token_list, parent_h, feed.parent_row_list, s.n - 1 + feed.depth, 0, s.n + fed,
                                   s.n, seen, 0)
        mask = torch.cat([torch.ones(f, s.n, dtype=torch.bool, device=dev), feed.mask.to(dev)], dim=1)
        pos = torch.full((1, f), s.n - 1 + feed.depth, device=dev)
        feats = parent_h[feed.parent_rows.to(dev)][None]
        h = self.head(self._embed(feed.tokens.to(dev)[None]), feats, pos, s.cache, s.n + fed, mask[None])[0]
        return HeadOut(h, self._logp(h))

    def _native_taps(self, feats: TargetFeatures) -> list[torch.Tensor] | None:
        """The target's taps for the native call where it fuses them itself (EAGLE-3: Eagle3Drafter), else None."""
        return None

    def _fast_call(self, tokens: list[int], feats: torch.Tensor | None, rows: list[int] | None, pos0: int,
                   pos_step: int, write_start: int, prefix: int, seen: list[list[int]], logits_from: int,
                   taps: list[torch.Tensor] | None = None) -> HeadOut:
        """The head over T <= FAST_ROWS rows on the compiled kernels: row i takes ``tokens[i]``, feature
        ``feats[rows[i]]`` (``feats[i]`` without rows), position pos0 + pos_step * i, writes head slot write_start + i
        and attends the head's slots below ``prefix`` and then prefix + j for j in ``seen[i]``. Log-probs of rows
        logits_from .. T - 1. One native call, with each row's top-k for a dynamic tree, where ``self.step`` serves
        (eyas.drafters.head_step; ``taps`` instead of feats: ``_native_taps``); else the torch fast path.
        """
        s = self.state
        if self.step is not None:
            k = self.expansion.cfg.top_k if isinstance(self.expansion, DynamicExpansion) else 0
            return self.step(tokens, feats, rows, pos0, pos_step, s.cache, write_start, prefix, seen, logits_from, k,
                             taps)
        dev = feats.device
        pos = pos0 + pos_step * torch.arange(len(tokens), device=dev)
        hid = feats if rows is None else feats[torch.tensor(rows, device=dev)]
        h = self.head.fast_forward(self._embed(torch.tensor(tokens, device=dev)), hid, pos, s.cache, write_start,
                                   HeadPaths.from_seen(prefix, seen))
        return HeadOut(h, self._logp(h[logits_from:]))


def head_compute_dtype(target) -> torch.dtype:
    """The dtype a draft head runs in: the target's.

    ``--dtype auto`` picks bfloat16 only where bf16 matmuls are native (a GPU, a CPU with AVX512-BF16
    or AMX); there the head's bf16 GEMMs are the fast ones too (measured +12 % tok/s over an fp32 head
    on the AVX512-BF16 VM, same tau). The draft's precision never changes the output (verification
    decides), only its speed.
    """
    return target.dtype


def head_cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 for a 16-bit head on a CPU: torch's CPU attention is several times faster in fp32 (as the target's)."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def random_head(target_cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> EagleHead:
    """An untrained head for a target (tests: a random head must still be lossless)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**target_cfg.__dict__, "num_layers": 1})
    return EagleHead(cfg).to(dtype).eval().requires_grad_(False)
