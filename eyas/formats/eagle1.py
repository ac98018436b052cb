"""EAGLE-1 heads in the SafeAILab reference layout, which ``eyas.drafters.eagle.load_eagle_head`` reads.

Sources (read, not copied):

* SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1 ``Model``): ``fc = Linear(2D, D, bias=bias)``,
  ``layers = [LlamaDecoderLayer(config, index)]`` where layer 0 has no ``input_layernorm``,
  ``embed_tokens`` (a frozen copy of the target's); ``ea_model.py`` reads ``bias`` from
  config.json (default true) and the head's config is the target's LlamaConfig.
* vLLM ``vllm/model_executor/models/llama_eagle.py`` (vllm-project/vllm 00da923): layer 0's
  ``input_layernorm`` is an ``nn.Identity`` (so there is no such key), ``layers.{i}.*`` and ``fc.*``
  keys without a ``model.`` prefix, ``embed_tokens`` skipped (shared with the target), and ``fc``
  built with ``bias=False``. Its decoder layer is ``models/llama.py`` ``LlamaDecoderLayer``, which
  reads ``attention_bias = config.attention_bias or config.bias`` (vllm 0035bdf): in vLLM a
  ``bias: true`` turns on q/k/v/o biases, not an fc bias. So the ``vllm`` layout below writes no
  ``fc.bias`` and ``bias: false`` (and refuses a head whose fc bias is not zero), and expresses
  Qwen2's q/k/v-only bias as ``attention_bias: true`` with a zero ``o_proj.bias``.
  ``vllm/transformers_utils/configs/eagle.py`` turns ``LlamaForCausalLM`` into
  ``EagleLlamaForCausalLM``.
* SGLang ``python/sglang/srt/models/llama_eagle.py``: the same keys, but ``fc`` always has a
  bias (``nn.Linear`` default), so SGLang needs ``fc.bias``; its ``models/llama.py``
  ``LlamaDecoderLayer`` (sglang 0023954) also reads ``attention_bias or bias`` as the attention bias.

So the ``safeailab`` layout always writes ``fc.bias`` (zeros for a head without one: the same
head) and never the ``bias`` key: SafeAILab then builds fc with a bias (its default) and SGLang
builds no attention bias the head does not have.

Weights (``model.safetensors``):

    fc.weight [D, 2D], fc.bias [D] (zeros when the head has none; not in the vllm layout)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias for Qwen2 targets)
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
    embed_tokens.weight (only for heads with their own embedding)
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.drafters.eagle import EagleHead
from eyas.formats import ARCHITECTURES, hf_config_dict, save_tensors, write_json

LAYOUTS = ("safeailab", "vllm")


def eagle1_config_json(
    head: EagleHead, target_name: str | None = None, dtype: torch.dtype | None = None, layout: str = "safeailab"
) -> dict:
    """config.json: the target's config with one layer (module docstring: no ``bias`` key but in vLLM's)."""
    m = head.config
    cfg = hf_config_dict(m, dtype or head.fc.weight.dtype)
    cfg["architectures"] = [ARCHITECTURES.get(m.model_type, "LlamaForCausalLM")]
    cfg["num_hidden_layers"] = 1
    if layout == "vllm":
        # vLLM: one Llama layer whose attention_bias covers q/k/v/o (o_proj bias written as zeros)
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], bias=False,
                   attention_bias=m.qkv_bias or m.o_bias)
    if target_name:
        cfg["eyas_target"] = target_name  # informational; engines ignore unknown keys
    return cfg


def save_eagle1(
    head: EagleHead, out_dir, target_name: str | None = None, dtype: torch.dtype | None = None,
    layout: str = "safeailab",
) -> Path:
    """Write ``head`` as config.json + model.safetensors in the SafeAILab or vLLM EAGLE-1 layout.

    Keys are the head's own parameter names, which are the reference names
    (``eyas.drafters.eagle.EagleHead``). ``dtype`` casts float tensors (default: as they are).
    ``layout="vllm"`` raises ValueError for a head vLLM's EAGLE-1 model cannot compute.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-1 layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    sd = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    if layout == "vllm":
        sd = _vllm_state_dict(head, sd)
    elif "fc.bias" not in sd:  # SafeAILab's default and SGLang's only fc have a bias: a zero one is no bias
        sd["fc.bias"] = sd["fc.weight"].new_zeros(sd["fc.weight"].shape[0])
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(sd, out / "model.safetensors")
    write_json(out / "config.json", eagle1_config_json(head, target_name, dtype, layout))
    return out


def _vllm_state_dict(head: EagleHead, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's tensors as vLLM's EagleLlamaForCausalLM builds them (module docstring)."""
    m = head.config
    problems = []
    bias = sd.pop("fc.bias", None)
    if bias is not None and bool(bias.any()):
        problems.append("its fc has a nonzero bias, but vLLM builds fc without one (llama_eagle.py)")
    if m.qk_norm:
        problems.append("its layer has q/k norms (Qwen3), which vLLM's Llama EAGLE layer does not have")
    if m.o_bias and not m.qkv_bias:
        problems.append("it has an o_proj bias without q/k/v biases; vLLM's attention_bias covers all four")
    if problems:
        raise ValueError(
            "cannot write this EAGLE-1 head in vLLM's layout: " + "; ".join(problems)
            + ". Write it with --to eagle1 (SafeAILab/SGLang layout), or train it without an fc bias."
        )
    o = "layers.0.self_attn.o_proj.bias"
    if m.qkv_bias and o not in sd:  # Qwen2: q/k/v bias only; vLLM's flag adds an o_proj bias, so give it zeros
        w = sd["layers.0.self_attn.o_proj.weight"]
        sd[o] = w.new_zeros(w.shape[0])
    return sd


__all__ = ["save_eagle1", "eagle1_config_json", "LAYOUTS"]
