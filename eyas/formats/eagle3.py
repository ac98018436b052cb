"""EAGLE-3 heads in the ``LlamaForCausalLMEagle3`` layout that vLLM, SGLang and TensorRT-LLM load.

Sources (read, not copied; each expectation below cites one of them):

* vLLM   ``vllm/model_executor/models/llama_eagle3.py`` (layer, ``load_weights``),
  ``vllm/model_executor/models/llama.py`` (aux capture), ``vllm/v1/worker/gpu_model_runner.py``
  / ``eagle3_utils.py`` ``get_eagle3_aux_layers_from_config``, ``transformers_utils/configs/eagle.py``.
* SGLang ``python/sglang/srt/models/llama_eagle3.py``, ``models/llama.py``
  ``set_eagle3_layers_to_capture``, ``model_executor/model_runner.py`` (reads ``eagle_config``).
* TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_speculative.py`` (``Eagle3DecoderLayer``,
  ``Eagle3DraftModel``, ``Eagle3ForCausalLM.load_weights``), ``_torch/speculative/eagle3.py``.
* SafeAILab/EAGLE ``eagle/model/cnets.py`` (``LlamaDecoderLayeremb``, ``Model``: EAGLE-3 reference).

Weights (``model.safetensors``, no ``embed_tokens``: the head embeds with the target's):

    fc.weight                          [H, 3 * H_target]   no bias
    midlayer.self_attn.{q,k,v}_proj.*  input 2H = [input_layernorm(emb), hidden_norm(hidden)]
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight, norm.weight
    lm_head.weight                     [Vd, H]
    d2t                                [Vd] int64, target_id = draft_id + d2t[draft_id]
    t2d                                [V] bool, target id is in the draft vocabulary

A head of N > 1 decoder layers (``num_hidden_layers`` N) adds plain Llama layers after ``midlayer``, written
``layers.1.*`` .. ``layers.{N-1}.*``: vLLM's names (``llama_eagle3.py`` builds ``layers.{i}`` and renames
``midlayer.`` to ``layers.0.``) and speculators' (``models/eagle3/core.py``: the first layer, then plain decoder
layers; its library computes eyas's logits, tests/formats/test_speculators_library.py); read also from
TensorRT-LLM's ``midlayer.{i}.*``. SGLang's EAGLE-3 model reads ``midlayer.*`` alone and llama.cpp's eagle3 graph
builds one layer: such a head runs on eyas, vLLM and speculators.

Aux layer ids: eyas's ``aux_layers`` are vLLM's ids (id i = residual entering target
layer i = HF ``hidden_states[i]``; ``llama.py`` captures ``hidden_states + residual``
before layer i). config.json holds them twice: top-level
``eagle_aux_hidden_state_layer_ids`` (what vLLM reads) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention, one lower
(SGLang's ``set_eagle3_layers_to_capture`` adds 1 before capturing ahead of a layer;
since sgl-project/sglang#25454 it adds 1 only when the first id is 1, which holds
for the default taps (2, L//2, L-3)). TensorRT-LLM does not read them from the
checkpoint: pass ``eagle3_layers_to_capture = {i - 1 for i in aux_layers}`` (its
default ``(1, L//2 - 1, L - 4)`` is the same default). All three engines
concatenate the captured features in ascending layer order, so ``save_eagle3``
writes the ids sorted and permutes ``fc``'s column blocks to match.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from eyas.drafters.eagle import HeadMismatchError
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head, default_eagle3_taps
from eyas.formats import hf_config_dict, read_config, read_weights, save_tensors, weight_keys, write_json
from eyas.formats.eagle3_checks import (
    EXTRA_PREFIX,
    check_aux,
    check_dense_layer,
    check_fc,
    check_options,
    layer_count,
)
from eyas.formats.speculators import (
    SPECULATORS_LAYER_PREFIX,
    flatten_speculators_config,
    is_speculators_config,
    write_speculators_config,
)
from eyas.formats.verifier import Verifier, resolve_verifier
from eyas.models.config import ModelConfig

# vLLM registry / SGLang EntryClass / SafeAILab config.json name of this layout
ARCHITECTURE = "LlamaForCausalLMEagle3"
_LATER_LAYER = re.compile(r"(?:layers|midlayer)\.([1-9][0-9]*)\.")
LAYER_PREFIX = "midlayer."  # SGLang reads only this name; vLLM and TRT-LLM also read layers.0.


# ---- writing ------------------------------------------------------------------------------------
def save_eagle3(
    head: Eagle3Head,
    out_dir,
    target_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    speculators: bool = False,
    verifier: Verifier | None = None,
) -> Path:
    """Write ``head`` as config.json + model.safetensors that the engines load.

    speculators=False: the ``LlamaForCausalLMEagle3`` layout (vLLM, SGLang, TensorRT-LLM).
    speculators=True: the vllm-project/speculators layout (vLLM, speculators; not SGLang),
    see ``eyas.formats.speculators``; its verifier is ``verifier``, else ``target_name``
    resolved by ``eyas.formats.verifier.resolve_verifier`` (an eyas target name, a directory,
    a .gguf or a hub id). Float tensors are cast to ``dtype``.
    """
    check_portable(head, speculators)
    if speculators and verifier is None and target_name:
        verifier = resolve_verifier(target_name)
    cfg = replace(head.cfg, aux_layers=tuple(sorted(head.cfg.aux_layers)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = SPECULATORS_LAYER_PREFIX if speculators else LAYER_PREFIX
    save_tensors(engine_state_dict(head, dtype, prefix), out / "model.safetensors")
    if speculators:
        write_speculators_config(cfg, out, verifier, dtype)
    else:
        write_json(out / "config.json", eagle3_config_json(cfg, target_name, dtype))
    return out


def check_portable(head: Eagle3Head, speculators: bool = False) -> None:
    """Raise ValueError if the engines' EAGLE-3 layer cannot express ``head``.

    ``norm_before_residual`` (residual = hidden_norm(hidden)) is read by vLLM, speculators and
    llama.cpp, but SGLang (``llama_eagle3.py``) and TensorRT-LLM (``Eagle3DecoderLayer``) always add
    the raw hidden state: such a head is refused for the LlamaForCausalLMEagle3 layout they load.
    """
    m, aux = head.cfg.model, head.cfg.aux_layers
    problems = []
    if head.cfg.norm_before_residual and not speculators:
        problems.append(
            "it sets norm_before_residual=true, which SGLang and TensorRT-LLM ignore (they add the raw "
            "hidden state), so they would compute a different head; export it with --to speculators "
            "(vLLM) or --to gguf (llama.cpp), which honour the flag"
        )
    if m.qk_norm:  # no engine's EAGLE-3 layer has q_norm/k_norm (a Qwen3 flag copied from the target)
        problems.append("its layer has q_norm/k_norm (qk_norm=True), which no engine's EAGLE-3 layer has")
    if m.qkv_bias != m.o_bias:  # one attention_bias flag covers q/k/v and o_proj (vLLM, TRT-LLM, speculators)
        problems.append(
            f"it has q/k/v bias={m.qkv_bias} but o_proj bias={m.o_bias} (Qwen2 flags); the engines "
            "read one attention_bias flag for all four projections"
        )
    if m.hidden_size != head.cfg.target_hidden_size:
        problems.append(
            f"its hidden size {m.hidden_size} differs from the target's {head.cfg.target_hidden_size}; "
            "engines then need the head's own embed_tokens, which Eagle3Head does not have"
        )
    if len(aux) != 3:  # vLLM and SGLang build fc with 3 * target_hidden_size inputs
        problems.append(f"it fuses {len(aux)} target layers {aux}; vLLM and SGLang build fc for exactly 3")
    if len(set(aux)) != len(aux):  # engines capture each layer once
        problems.append(f"its aux layers {aux} repeat a layer; engines capture each layer once")
    if problems:
        layout = "speculators" if speculators else "LlamaForCausalLMEagle3"
        raise ValueError(
            f"cannot write this EAGLE-3 head in the {layout} layout: "
            + "; ".join(problems)
            + ". Heads eyas trains (Eagle3Config.for_target: a plain Llama layer without q/k norm or "
            "Qwen biases, three distinct aux layers, norm_before_residual false) export everywhere."
        )


def engine_state_dict(
    head: Eagle3Head, dtype: torch.dtype = torch.bfloat16, layer_prefix: str = LAYER_PREFIX
) -> dict[str, torch.Tensor]:
    """The head's tensors under engine key names, aux feature blocks in ascending layer order."""
    aux = list(head.cfg.aux_layers)
    order = sorted(range(len(aux)), key=aux.__getitem__)
    sd = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu()
        if name == "fc.weight" and order != list(range(len(aux))):
            d, n = t.shape
            t = t.view(d, len(aux), n // len(aux))[:, order].reshape(d, n)
        if name.startswith(LAYER_PREFIX):
            name = layer_prefix + name[len(LAYER_PREFIX) :]
        elif name.startswith(EXTRA_PREFIX):  # extra_layers.{j}. -> layers.{j + 1}.
            j, rest = name[len(EXTRA_PREFIX) :].split(".", 1)
            name = f"layers.{int(j) + 1}.{rest}"
        if name == "d2t":
            t = t.long()  # int64 offsets: SafeAILab cnets.py, vLLM draft_id_to_target_id
        elif name == "t2d":
            t = t.bool()
        else:
            t = t.to(dtype)
        sd[name] = t
    return sd


def eagle3_config_json(
    head_cfg: Eagle3Config, target_name: str | None = None, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """config.json of the LlamaForCausalLMEagle3 layout (a LlamaConfig plus EAGLE-3 keys)."""
    cfg = hf_config_dict(head_cfg.model, dtype)
    aux = list(head_cfg.aux_layers)
    cfg.update(
        architectures=[ARCHITECTURE],
        model_type="llama",  # every engine builds a Llama layer for this architecture
        num_hidden_layers=head_cfg.model.num_layers,
        tie_word_embeddings=False,  # SGLang ties lm_head to embed_tokens when true (llama_eagle3.py)
        bias=False,  # SGLang and TRT-LLM: fc bias; vLLM llama_eagle3.py: o_proj bias (config.bias)
        draft_vocab_size=head_cfg.draft_vocab_size,  # all three size lm_head from it
        target_hidden_size=head_cfg.target_hidden_size,  # vLLM/SGLang/TRT-LLM: fc input = 3 * this
        # vLLM llama_eagle3.py: residual = raw hidden unless this is true (eyas's Eagle3Layer)
        norm_before_residual=bool(getattr(head_cfg, "norm_before_residual", False)),
        # vLLM get_eagle3_aux_layers_from_config reads this top-level key (vLLM convention)
        eagle_aux_hidden_state_layer_ids=aux,
        # SGLang model_runner reads eagle_config[...] and adds 1 (see module docstring);
        # vLLM llama_eagle3.py reads use_aux_hidden_state from here
        eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
    )
    if target_name:
        cfg["eyas_target"] = target_name  # informational; engines ignore unknown keys
    return cfg


# ---- reading ------------------------------------------------------------------------------------
def looks_like_eagle3_dir(path) -> bool:
    """Whether a directory's weights are an EAGLE-3 head, by key names only (no tensor reads).

    ``midlayer.*`` (SafeAILab, SpecForge, this layout), ``d2t`` (any reduced vocabulary) or a
    ``hidden_norm`` (speculators' ``layers.0.hidden_norm``; EAGLE-1 layers have none). Check this
    before ``looks_like_eagle_dir``: a speculators EAGLE-3 head also has ``fc.*`` + ``layers.0.*``.
    """
    keys = {k.removeprefix("model.") for k in weight_keys(Path(path))}
    return "d2t" in keys or any(k.startswith(LAYER_PREFIX) or k.endswith("hidden_norm.weight") for k in keys)


def load_eagle3(path, target_cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load an EAGLE-3 head (this layout, SafeAILab/SpecForge or speculators) and check it fits the target."""
    p = Path(path)
    raw = read_config(p)
    flat = flatten_speculators_config(raw) if is_speculators_config(raw) else raw
    sd, embed = canonical_state_dict(read_weights(p))
    cfg = head_config(flat, sd, target_cfg, p)
    if embed is not None and tuple(embed.shape) != (target_cfg.vocab_size, target_cfg.hidden_size):
        raise HeadMismatchError(
            f"EAGLE-3 head {p}: embed_tokens is {tuple(embed.shape)} but the target's "
            f"embedding is ({target_cfg.vocab_size}, {target_cfg.hidden_size}): this head was "
            "trained for a different target model"
        )
    head = Eagle3Head(cfg)
    _load_weights(head, sd, p)
    return head.to(dtype).eval().requires_grad_(False)


def canonical_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Map the key names trainers and engines use onto Eagle3Head's; returns (tensors, embed_tokens).

    ``model.`` prefixes are dropped, ``layers.0.`` (speculators, accepted by vLLM and
    TRT-LLM) and ``midlayer.0.`` (TRT-LLM multi-layer naming) become ``midlayer.``, a
    multi-layer head's ``layers.{i}.`` / ``midlayer.{i}.`` (i >= 1) ``extra_layers.{i - 1}.``, and
    vLLM's ``draft_id_to_target_id`` becomes ``d2t``. ``embed_tokens.weight`` (SafeAILab,
    SpecForge and speculators keep a copy of the target's) is split off: eyas embeds
    with the target's own embedding.
    """
    out, embed = {}, None
    for key, t in sd.items():
        name = key.removeprefix("model.")
        for alias in ("layers.0.", "midlayer.0."):
            if name.startswith(alias):
                name = LAYER_PREFIX + name[len(alias) :]
        later = _LATER_LAYER.match(name)  # a multi-layer head's layers 1.. (vLLM, TRT-LLM names)
        if later:
            name = f"{EXTRA_PREFIX}{int(later.group(1)) - 1}.{name[later.end() :]}"
        if name == "draft_id_to_target_id":
            name = "d2t"
        if name == "embed_tokens.weight":
            embed = t
            continue
        out[name] = t
    return out, embed


def aux_layers_from_config(cfg: dict, target_cfg: ModelConfig) -> tuple[int, ...]:
    """Aux layer ids in vLLM's convention, ascending (the order the engines concatenate in)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")  # vLLM and speculators: as is
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids and sglang:
        # SGLang/SpecForge ids count one lower when the smallest is 1 (sgl-project/sglang#25454)
        ids = [int(i) + 1 for i in sglang] if min(sglang) == 1 else list(sglang)
    if not ids:
        ids = default_eagle3_taps(target_cfg.num_layers)  # vLLM/SGLang default (2, L//2, L-3)
    ids = tuple(sorted(int(i) for i in ids))
    if len(set(ids)) != len(ids):
        raise HeadMismatchError(
            f"EAGLE-3 aux layer ids {ids} repeat a layer (a {target_cfg.num_layers}-layer "
            "target's default taps collide): set distinct eagle_aux_hidden_state_layer_ids"
        )
    return ids


def head_config(cfg: dict, sd: dict[str, torch.Tensor], target_cfg: ModelConfig, where) -> Eagle3Config:
    """Eagle3Config from a flat config dict and the weights, checked against the target."""
    extra = check_options(cfg, where)
    check_dense_layer(sd, where)
    fc = sd.get("fc.weight")
    if fc is None:
        raise HeadMismatchError(f"{where} is not an EAGLE-3 head: no fc.weight (keys: {sorted(sd)[:6]})")
    aux = aux_layers_from_config(cfg, target_cfg)
    check_fc(fc, aux, cfg, target_cfg, where)
    check_aux(aux, target_cfg, where)
    vocab = cfg.get("vocab_size") or target_cfg.vocab_size
    if vocab != target_cfg.vocab_size:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} was trained for a vocabulary of {vocab} tokens but the "
            f"target has {target_cfg.vocab_size}: use the target (tokenizer) it was trained for"
        )
    lm = sd.get("lm_head.weight")
    if lm is None:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} has no lm_head.weight; heads that borrow the target's "
            "lm_head are not supported"
        )
    if cfg.get("draft_vocab_size") not in (None, lm.shape[0]):
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: config.json draft_vocab_size={cfg['draft_vocab_size']} "
            f"but lm_head.weight has {lm.shape[0]} rows"
        )
    layers = layer_count(cfg, sd, where)
    try:
        layer = {**cfg, "model_type": "llama", "num_hidden_layers": layers, "vocab_size": vocab}
        model = ModelConfig.from_hf(layer)
    except (KeyError, ValueError) as e:
        msg = f"EAGLE-3 head {where}: config.json cannot describe the layer ({e})"
        raise HeadMismatchError(msg) from None
    return Eagle3Config(model=model, draft_vocab_size=lm.shape[0], aux_layers=aux,
                        target_hidden_size=target_cfg.hidden_size, **extra)


def _load_weights(head: Eagle3Head, sd: dict[str, torch.Tensor], where) -> None:
    d2t, t2d = sd.pop("d2t", None), sd.pop("t2d", None)
    try:
        missing, unexpected = head.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        msg = f"EAGLE-3 head {where}: config.json does not match the weights: {e}"
        raise HeadMismatchError(msg) from None
    missing = [m for m in missing if m not in ("d2t", "t2d")]
    if missing or unexpected:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    _set_vocab_map(head, d2t, t2d, where)


def _set_vocab_map(head: Eagle3Head, d2t: torch.Tensor | None, t2d: torch.Tensor | None, where) -> None:
    """d2t is authoritative (engines ignore t2d); t2d is rebuilt from it."""
    vd, v = head.cfg.draft_vocab_size, head.cfg.model.vocab_size
    if t2d is not None and t2d.shape[0] != v:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: t2d covers {t2d.shape[0]} target tokens but the target "
            f"vocabulary has {v}: this head was trained for a different tokenizer"
        )
    if d2t is None:
        if vd != v:
            raise HeadMismatchError(f"EAGLE-3 head {where} drafts over {vd} of {v} tokens but has no d2t map")
        return  # identity: Eagle3Head's initial buffers
    if tuple(d2t.shape) != (vd,):
        raise HeadMismatchError(f"EAGLE-3 head {where}: d2t has shape {tuple(d2t.shape)}, expected ({vd},)")
    ids = torch.arange(vd) + d2t.long()
    if ids.min() < 0 or ids.max() >= v or ids.unique().numel() != vd:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: d2t maps draft ids outside the {v}-token target "
            "vocabulary or onto the same token twice"
        )
    head.d2t.copy_(d2t.long())
    head.t2d.zero_()
    head.t2d[ids] = True


__all__ = ["ARCHITECTURE", "save_eagle3", "load_eagle3", "looks_like_eagle3_dir", "check_portable",
           "engine_state_dict", "eagle3_config_json", "canonical_state_dict", "aux_layers_from_config"]
