"""EAGLE-3 heads as GGUF files that llama.cpp loads as draft models (``--spec-type draft-eagle3``).

What llama.cpp expects, read in the sources vendored by llama-cpp-python 0.3.36 (llama.cpp
0c1e570, 2026-10-01; EAGLE-3 support: ggml-org/llama.cpp#18039, converter #24977):

* architecture ``eagle3`` (``src/llama-arch.cpp`` ``LLM_ARCH_EAGLE3``); hparams
  (``src/models/eagle3.cpp`` ``load_arch_hparams``): ``eagle3.target_layers`` (exactly 3 ids,
  each the *input* of that target layer: ``common/speculative.cpp`` calls
  ``llama_set_embeddings_layer_inp``, vLLM's convention and eyas's ``aux_layers``),
  ``eagle3.target_hidden_size``, optional ``eagle3.norm_before_residual`` and
  ``eagle3.norm_before_fc``, plus the usual Llama keys (``block_count`` 1, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count[_kv]``, ``attention.key_length``,
  ``rope.freq_base``, ``rope.dimension_count``, ``attention.layer_norm_rms_epsilon``,
  ``vocab_size``) that ``convert_hf_to_gguf.py`` writes (``conversion/base.py``
  ``TextModel.set_gguf_parameters``);
* tensors (``eagle3.cpp`` ``load_arch_tensors``): ``fc.weight`` [3 * H_target, H] (ggml order),
  ``blk.0.attn_norm`` (input_layernorm, on the token embedding), ``blk.0.attn_norm_2``
  (hidden_norm), ``blk.0.attn_{q,k,v}`` reading 2H, ``blk.0.attn_output``, ``blk.0.ffn_norm``,
  ``blk.0.ffn_{gate,up,down}``, ``output_norm``, ``output`` [H, Vd], optional ``rope_freqs``
  and ``d2t`` (I64, *absolute* target ids: ``conversion/llama.py`` ``prepare_tensors`` adds
  ``arange``); no ``token_embd`` (the target's is used), no biases;
* q/k rows permuted from Hugging Face's rotate-half layout to GGML's interleaved RoPE
  (``conversion/llama.py`` ``LlamaModel.permute``; eagle3 uses ``LLAMA_ROPE_TYPE_NORM``);
* the target's vocabulary in ``tokenizer.*``: ``common/speculative.cpp``
  ``common_speculative_are_compatible`` compares vocab type, BOS/EOS and token texts of draft
  and target, so the keys are copied from the target's own GGUF.

``save_eagle3_gguf`` writes that; ``load_eagle3_gguf`` reads it back into an ``Eagle3Head``
(round trips are exact in float32).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eyas.drafters.eagle import HeadMismatchError
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head
from eyas.formats.eagle3 import check_portable

ARCH = "eagle3"
_LAYER = "midlayer."
# eyas parameter name (after "midlayer.") -> llama.cpp tensor name (gguf-py constants.py TENSOR_NAMES)
_LAYER_TENSORS = {
    "input_layernorm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
_TENSORS = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_TENSORS.update({_LAYER + k: v for k, v in _LAYER_TENSORS.items()})
# torch dtype of 2-D weights -> (GGML type, general.file_type); 1-D norms are always F32
_DTYPES = {torch.float32: ("F32", 0), torch.float16: ("F16", 1), torch.bfloat16: ("BF16", 32)}


# ---- q/k row order --------------------------------------------------------------------------------
def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[n_head * Dh, X] rotate-half rows -> GGML's interleaved (conversion/llama.py permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_rows``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- writing --------------------------------------------------------------------------------------
def check_gguf_portable(head: Eagle3Head) -> None:
    """Raise ValueError for what llama.cpp's eagle3 graph cannot compute (it has no bias tensors)."""
    check_portable(head, speculators=True)  # the engines' common limits; norm_before_residual is fine here
    m = head.cfg.model
    if m.num_layers != 1:
        raise ValueError(
            f"cannot write this EAGLE-3 head as GGUF: it has {m.num_layers} decoder layers, and llama.cpp's eagle3 "
            "graph (src/models/eagle3.cpp) builds one; vLLM loads it (eyas convert --to eagle3)"
        )
    if m.qkv_bias or m.o_bias:
        raise ValueError(
            "cannot write this EAGLE-3 head as GGUF: its attention has biases, and llama.cpp's eagle3 "
            "layer (src/models/eagle3.cpp) loads no bias tensors"
        )


def save_eagle3_gguf(
    head: Eagle3Head, path, vocab_from: Path | None = None, dtype: torch.dtype = torch.float32, name: str = ""
) -> Path:
    """Write ``head`` as a llama.cpp EAGLE-3 draft GGUF; returns the file.

    ``vocab_from``: the target's GGUF file, whose ``tokenizer.*`` keys are copied (llama.cpp refuses
    a draft whose vocabulary differs from the target's; None writes none, for tests only).
    ``dtype``: float32, float16 or bfloat16 for the matrices (norms stay float32).
    """
    import gguf

    if dtype not in _DTYPES:
        raise ValueError(f"GGUF export supports float32, float16 and bfloat16, not {dtype}")
    check_gguf_portable(head)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), ARCH)
    _write_hparams(w, head.cfg, _DTYPES[dtype][1], name)
    if vocab_from is not None:
        _copy_vocab(w, Path(vocab_from))
    for key, t in gguf_tensors(head, dtype).items():
        array, raw_dtype = _to_numpy(t)
        w.add_tensor(key, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _write_hparams(w, cfg: Eagle3Config, file_type: int, name: str) -> None:
    m, a = cfg.model, ARCH
    w.add_name(name or "eyas EAGLE-3 head")
    w.add_uint32(f"{a}.block_count", 1)
    w.add_uint32(f"{a}.context_length", m.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", m.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", m.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", m.num_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", m.num_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", m.head_dim)
    w.add_uint32(f"{a}.attention.value_length", m.head_dim)
    w.add_float32(f"{a}.rope.freq_base", m.rope_theta)
    w.add_uint32(f"{a}.rope.dimension_count", m.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", m.rms_norm_eps)
    w.add_uint32(f"{a}.vocab_size", m.vocab_size)
    w.add_uint32("general.file_type", file_type)
    w.add_array(f"{a}.target_layers", sorted(cfg.aux_layers))
    w.add_uint32(f"{a}.target_hidden_size", cfg.target_hidden_size)
    w.add_bool(f"{a}.norm_before_residual", bool(cfg.norm_before_residual))
    w.add_bool(f"{a}.norm_before_fc", False)


def _copy_vocab(w, target_gguf: Path) -> None:
    """Copy the target's ``tokenizer.*`` keys (what llama.cpp compares between draft and target)."""
    from gguf import GGUFReader, GGUFValueType

    if not target_gguf.is_file():
        raise FileNotFoundError(f"the target GGUF {target_gguf} does not exist")
    fields = [f for k, f in GGUFReader(str(target_gguf)).fields.items() if k.startswith("tokenizer.")]
    if not fields:
        raise ValueError(f"{target_gguf} has no tokenizer.* keys to copy into the draft")
    for f in fields:
        array = f.types[0] == GGUFValueType.ARRAY
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)


def gguf_tensors(head: Eagle3Head, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """llama.cpp tensor name -> tensor (torch shapes; GGUF stores the reversed ggml order)."""
    m = head.cfg.model
    order = sorted(range(len(head.cfg.aux_layers)), key=head.cfg.aux_layers.__getitem__)
    out: dict[str, torch.Tensor] = {}
    for key, t in head.state_dict().items():
        if key in ("d2t", "t2d"):
            continue
        t = t.detach().float().cpu()
        if key == "fc.weight":  # column blocks in ascending layer order (what target_layers lists)
            d, n = t.shape
            t = t.view(d, len(order), n // len(order))[:, order].reshape(d, n)
        elif key.endswith("q_proj.weight"):
            t = permute_rows(t, m.num_heads)
        elif key.endswith("k_proj.weight"):
            t = permute_rows(t, m.num_kv_heads)
        out[_TENSORS[key]] = t if t.ndim == 1 else t.to(dtype)
    rope = _rope_factors(head)
    if rope is not None:
        out["rope_freqs.weight"] = rope
    out["d2t"] = head.draft_ids().cpu().long()  # absolute target ids (conversion/llama.py prepare_tensors)
    return out


def _rope_factors(head: Eagle3Head) -> torch.Tensor | None:
    """[Dh / 2] llama.cpp ``rope_freqs`` (frequency divisors) for any scaling; None when unscaled."""
    m = head.cfg.model
    plain = replace(m, rope_scaling={}).inv_freq()
    factors = plain / m.inv_freq()
    return None if torch.equal(factors, torch.ones_like(factors)) else factors.float()


def _to_numpy(t: torch.Tensor):
    """(array, raw_dtype) for GGUFWriter.add_tensor: bf16 travels as its raw 16-bit pattern."""
    import gguf

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if t.dtype == torch.int64:
        return t.numpy(), gguf.GGMLQuantizationType.I64
    return t.contiguous().numpy(), None


# ---- reading --------------------------------------------------------------------------------------
def is_eagle3_gguf(path) -> bool:
    """Whether ``path`` is a GGUF file whose architecture is eagle3 (reads the header only)."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return False
    return _fields(p).get("general.architecture") == ARCH


def _fields(p: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise HeadMismatchError(f"{p} is not a readable GGUF file ({e})") from None
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}


def load_eagle3_gguf(path, target_cfg, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Read a llama.cpp EAGLE-3 draft GGUF back into an ``Eagle3Head`` for ``target_cfg``.

    The layer's sizes come from the file; RoPE scaling from the target (eyas heads copy it;
    ``rope_freqs`` is checked against it).
    """
    from gguf import GGUFReader

    from eyas.formats.eagle3 import _load_weights, head_config

    p = Path(path)
    kv = _fields(p)
    if kv.get("general.architecture") != ARCH:
        raise HeadMismatchError(f"{p} is a GGUF of architecture {kv.get('general.architecture')!r}, not eagle3")
    sd = {t.name: _to_torch(t) for t in GGUFReader(str(p)).tensors}
    cfg = _flat_config(kv, target_cfg)
    head_sd = _head_state_dict(sd, cfg)
    head = Eagle3Head(head_config(cfg, head_sd, target_cfg, p))
    rope, want = sd.get("rope_freqs.weight"), _rope_factors(head)
    if (rope is None) != (want is None) or (rope is not None and not torch.allclose(rope, want)):
        raise HeadMismatchError(f"{p}: its RoPE scaling (rope_freqs) is not the target's")
    _load_weights(head, head_sd, p)
    return head.to(dtype).eval().requires_grad_(False)


def _flat_config(kv: dict, target_cfg) -> dict:
    """The GGUF hparams as the flat LlamaForCausalLMEagle3 config dict ``head_config`` reads."""
    a = ARCH
    if kv.get(f"{a}.norm_before_fc"):
        raise HeadMismatchError("this GGUF head sets norm_before_fc, which eyas's Eagle3Head does not implement")
    rope = {k: v for k, v in target_cfg.rope_scaling.items() if k != "rope_theta"}
    return {
        "model_type": "llama", "num_hidden_layers": kv.get(f"{a}.block_count", 1),
        "vocab_size": kv.get(f"{a}.vocab_size", target_cfg.vocab_size),
        "hidden_size": kv[f"{a}.embedding_length"], "intermediate_size": kv[f"{a}.feed_forward_length"],
        "num_attention_heads": kv[f"{a}.attention.head_count"],
        "num_key_value_heads": kv[f"{a}.attention.head_count_kv"],
        "head_dim": kv.get(f"{a}.attention.key_length") or 0,
        "rms_norm_eps": kv[f"{a}.attention.layer_norm_rms_epsilon"],
        "rope_theta": kv.get(f"{a}.rope.freq_base", target_cfg.rope_theta), "rope_scaling": rope or None,
        "max_position_embeddings": kv.get(f"{a}.context_length", target_cfg.max_position_embeddings),
        "target_hidden_size": kv[f"{a}.target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(kv[f"{a}.target_layers"]),
        "norm_before_residual": bool(kv.get(f"{a}.norm_before_residual", False)),
    }


def _head_state_dict(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """llama.cpp names -> Eagle3Head names, q/k rows back to rotate-half, d2t back to offsets."""
    names = {v: k for k, v in _TENSORS.items()}
    out = {}
    for key, t in sd.items():
        if key in ("rope_freqs.weight", "d2t"):
            continue
        if key not in names:
            raise HeadMismatchError(f"unexpected tensor {key!r} in an eagle3 GGUF (e.g. its own token_embd)")
        name = names[key]
        if name.endswith("q_proj.weight"):
            t = unpermute_rows(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = unpermute_rows(t, cfg["num_key_value_heads"])
        out[name] = t
    if "d2t" in sd:  # absolute target ids -> offsets (target id = draft id + d2t)
        out["d2t"] = sd["d2t"].long() - torch.arange(sd["d2t"].shape[0])
    return out


def _to_torch(t) -> torch.Tensor:
    """A GGUFReader tensor as a torch tensor in torch (reversed ggml) shape."""
    import gguf

    shape = [int(n) for n in reversed(t.shape.tolist())]
    kind = gguf.GGMLQuantizationType
    if t.tensor_type == kind.BF16:
        raw = np.ascontiguousarray(t.data).view(np.int16).reshape(shape)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16)
    if t.tensor_type not in (kind.F32, kind.F16, kind.I64):
        raise HeadMismatchError(f"tensor {t.name} is {t.tensor_type.name}; eyas reads F32, F16, BF16 and I64")
    return torch.from_numpy(np.ascontiguousarray(t.data).reshape(shape).copy())


__all__ = ["save_eagle3_gguf", "load_eagle3_gguf", "is_eagle3_gguf", "gguf_tensors", "check_gguf_portable",
           "permute_rows", "unpermute_rows", "ARCH"]
