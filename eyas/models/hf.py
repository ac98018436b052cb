"""Generic target adapter for any transformers causal LM (slow, but never locked out).

``HFTarget`` keeps no transformers KV cache. Its cache (``HFCache``) records,
for every slot, the token written there, its position and which slots it
attended when it was written. Each forward re-runs the model from scratch over
slots ``0 .. start + T`` (the committed prefix plus the T new tokens) with one
custom 4D attention mask, and returns the last T rows. Re-running a prefix row
with the visibility it had when it was written reproduces exactly the keys and
values a real KV cache would hold, so the outputs equal an incremental
forward's, at O((start + T)^2) cost per call instead of O((start + T) T).

Transformers conventions this relies on (checked against transformers 5.x):

* A 4D ``attention_mask`` of shape [B, 1, T, S] is passed through unchanged by
  ``masking_utils._preprocess_mask_arguments`` to the attention function. We
  give it as an additive float mask (0 = attend, ``finfo.min`` = blocked), the
  format both the ``eager`` (adds it to the scores) and ``sdpa`` paths accept.
  ``flash_attention_*`` and ``flex_attention`` cannot take such a mask, so the
  model is switched to ``sdpa`` (or ``eager`` where sdpa is unsupported).
* With ``output_hidden_states=True``, ``hidden_states[0]`` is the embedding
  output (= input to layer 0), ``hidden_states[i]`` the residual stream entering
  layer i, and ``hidden_states[-1]`` the *final-normed* feature: the
  ``capture_outputs`` decorator replaces the last layer's raw output with
  ``last_hidden_state`` (``tie_last_hidden_states``, on for all language models).
* Sliding-window layers build their window inside ``create_sliding_window_causal_mask``,
  which a custom 4D mask bypasses, so the window is applied here (by position
  distance): as a ``{layer_type: mask}`` dict for models with mixed
  ``layer_types`` (Qwen2, Gemma 2/3, ...), folded into the single mask otherwise
  (Mistral).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.models.base import ForwardMeta, ForwardOutput, TargetModel, causal_mask
from eyas.models.config import ModelConfig


@dataclass
class HFCache:
    """What every slot holds; stands in for a KV cache (see module docstring).

    ``seen`` costs B * S * S bytes (16 MiB per row at S = 4096). It is what makes
    masks other than plain causal (trees, left padding) reproduce exactly.
    """

    # [B, S] long, token written at each slot
    tokens: torch.Tensor
    # [B, S] long, absolute position of each slot's token
    positions: torch.Tensor
    # [B, S, S] bool, seen[b, i, j] = slot i attended slot j when it was written
    seen: torch.Tensor

    @classmethod
    def empty(cls, batch: int, max_slots: int, device: torch.device | str = "cpu") -> HFCache:
        z = torch.zeros(batch, max_slots, dtype=torch.long, device=device)
        seen = torch.zeros(batch, max_slots, max_slots, dtype=torch.bool, device=device)
        return cls(z, z.clone(), seen)

    @property
    def max_slots(self) -> int:
        return int(self.tokens.shape[1])

    def write(
        self,
        start: int,
        # [B, T] long
        tokens: torch.Tensor,
        # [B, T] long
        positions: torch.Tensor,
        # [B, T, start + T] bool
        mask: torch.Tensor,
    ) -> None:
        """Record T new slots at ``start .. start + T``."""
        n = start + tokens.shape[1]
        if n > self.max_slots:
            raise ValueError(
                f"cache overflow: writing slots {start}..{n} into a cache of {self.max_slots} "
                f"slots; raise max_slots (prompt + max_new_tokens + tree size)"
            )
        self.tokens[:, start:n] = tokens
        self.positions[:, start:n] = positions
        self.seen[:, start:n, :n] = mask

    def commit(self, start: int, src: torch.Tensor) -> None:
        """Move slots ``start + src[j]`` to ``start + j`` (same contract as ``KVCache.commit``).

        src: [A] long. Rows *and* columns of ``seen`` are gathered, so a moved
        slot keeps attending its (moved) ancestors: node src[j] saw src[k] (k < j)
        in the tree, so slot start + j now sees slot start + k. Columns past
        ``start + A`` keep stale values; ``visibility`` cuts them (row i only
        ever sees slots <= i).
        """
        a = src.shape[0]
        idx = src.to(self.tokens.device) + start
        # gather first, then write, so overlapping source/target slots are safe
        self.tokens[:, start : start + a] = self.tokens.index_select(1, idx)
        self.positions[:, start : start + a] = self.positions.index_select(1, idx)
        self.seen[:, start : start + a] = self.seen.index_select(1, idx)
        self.seen[:, :, start : start + a] = self.seen.index_select(2, idx)

    def visibility(self, n: int) -> torch.Tensor:
        """[B, n, n] bool: which of slots 0..n each of slots 0..n attends.

        Forced lower-triangular: a slot never attends a later slot. Causal
        chains and topologically ordered trees satisfy this; it also drops the
        stale columns ``commit`` and overwritten slots leave behind.
        """
        tril = torch.ones(n, n, dtype=torch.bool, device=self.seen.device).tril()
        return self.seen[:, :n, :n] & tril


class HFTarget(TargetModel):
    """A ``TargetModel`` over any transformers ``*ForCausalLM`` (see module docstring)."""

    def __init__(self, hf_model) -> None:
        if hf_model.config._attn_implementation not in ("eager", "sdpa"):
            _set_maskable_attention(hf_model)
        self.hf = hf_model.eval()
        self.config = _model_config(hf_model.config.get_text_config())
        params = inspect.signature(hf_model.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> HFTarget:
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # the architecture has no sdpa path: eager takes any 4D mask
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
        return cls(hf.requires_grad_(False))

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def modules(self):
        """The wrapped transformers model's modules: what checks over a target's projections read (none of them
        carries eyas's GGUF blocks or int8 weights here).
        """
        return self.hf.modules()

    def new_cache(self, batch: int, max_slots: int) -> HFCache:
        return HFCache.empty(batch, max_slots, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(hidden)

    @torch.inference_mode()
    def run(self, tokens, positions, cache, meta: ForwardMeta) -> ForwardOutput:
        """See ``TargetModel.run``. Mask columns past ``start + T`` are ignored.

        ``kv_len`` only sizes the mask in the native backend; here the forward
        always covers exactly slots ``0 .. start + T``. No path attention (``path_attention`` is False).
        """
        start, mask, taps, logits_idx = meta.start, meta.mask, meta.taps, meta.logits_idx
        if meta.paths is not None:
            raise ValueError("the transformers backend has no path attention; exact mode uses masks here")
        b, t = tokens.shape
        n = start + t
        if mask is None:
            mask = causal_mask(t, start, None, tokens.device).expand(b, t, n)
        assert mask.shape[:2] == (b, t) and mask.shape[2] >= n, (
            f"mask {tuple(mask.shape)} != [{b}, {t}, >={n}]"
        )
        bad = [i for i in taps if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"taps {bad} out of range: layers are 0..{self.config.num_layers - 1}")
        cache.write(start, tokens, positions, mask[:, :, :n])
        pos = cache.positions[:, :n]
        extra = {"logits_to_keep": t} if self._has_logits_to_keep else {}
        out = self.hf(
            input_ids=cache.tokens[:, :n],
            position_ids=pos,
            attention_mask=self._attention_mask(cache.visibility(n), pos),
            use_cache=False,
            output_hidden_states=True,
            **extra,
        )
        logits = out.logits[:, -t:]
        logits = logits if logits_idx is None else logits[:, logits_idx]
        hs = out.hidden_states
        return ForwardOutput(
            logits=logits.float(),
            hidden=hs[-1][:, -t:],
            taps={i: hs[i][:, -t:] for i in taps},
        )

    def commit(self, cache: HFCache, start: int, src: torch.Tensor) -> None:
        cache.commit(start, src)

    def _attention_mask(
        self,
        # [B, n, n] bool
        vis: torch.Tensor,
        # [B, n] long
        pos: torch.Tensor,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive [B, 1, n, n] mask(s) for the model, with sliding windows applied."""
        cfg = self.hf.config.get_text_config()
        window = getattr(cfg, "sliding_window", None)
        types = set(getattr(cfg, "layer_types", None) or ())
        if not window:
            return _additive(vis, self.dtype)
        # transformers' sliding_window_overlay: key k is visible from query q iff q - k < window
        windowed = vis & (pos[:, :, None] - pos[:, None, :] < window)
        if not types:  # one mask for every layer (Mistral): the window applies everywhere
            return _additive(windowed, self.dtype)
        if "sliding_attention" not in types:  # window configured but unused (Qwen2 default)
            return _additive(vis, self.dtype)
        masks = {
            "full_attention": _additive(vis, self.dtype),
            "sliding_attention": _additive(windowed, self.dtype),
        }
        return {k: v for k, v in masks.items() if k in types}


def _additive(
    # [B, n, n] bool, True = may attend
    vis: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[B, 1, n, n] float mask: 0 where visible, the dtype's minimum elsewhere."""
    m = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
    return m.masked_fill_(~vis, torch.finfo(dtype).min)[:, None]


def _set_maskable_attention(hf_model) -> None:
    """Switch flash / flex attention to one that takes a custom 4D float mask."""
    try:
        hf_model.set_attn_implementation("sdpa")
    except ValueError:
        hf_model.set_attn_implementation("eager")


def _model_config(cfg) -> ModelConfig:
    """ModelConfig for a transformers config: exact for native-supported types, else the basics."""
    d = cfg.to_dict()
    try:
        return ModelConfig.from_hf(d)
    except (ValueError, KeyError):
        pass
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    return ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=d.get("intermediate_size") or d.get("n_inner") or 4 * hidden,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or 0,
        max_position_embeddings=d.get("max_position_embeddings") or d.get("n_positions") or 4096,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        model_type=d.get("model_type", "unknown"),
    )
