"""EAGLE-1 heads in the SafeAILab reference layout, which ``eyas.drafters.eagle.load_eagle_head`` reads.

Sources (read, not copied):

* SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1 ``Model``): ``fc = Linear(2D, D, bias=bias)``,
  ``layers = [LlamaDecoderLayer(config, index)]`` where layer 0 has no ``input_layernorm``,
  ``embed_tokens`` (a frozen copy of the target's); ``ea_model.py`` reads ``bias`` from
  config.json (default true) and the head's config is the target's LlamaConfig.
* vLLM ``vllm/model_executor/models/llama_eagle.py``: layer 0's ``input_layernorm`` is an
  ``nn.Identity`` (so there is no such key), ``layers.{i}.*`` and ``fc.*`` keys without a
  ``model.`` prefix, ``embed_tokens`` skipped (shared with the target). Note: vLLM builds
  ``fc`` with ``bias=False``, so only heads saved with ``bias=false`` load there;
  ``vllm/transformers_utils/configs/eagle.py`` turns ``LlamaForCausalLM`` into
  ``EagleLlamaForCausalLM``.
* SGLang ``python/sglang/srt/models/llama_eagle.py``: the same keys, but ``fc`` always has a
  bias (``nn.Linear`` default), so SGLang needs ``fc.bias``.

Weights (``model.safetensors``):

    fc.weight [D, 2D], fc.bias [D] (when the head has one)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias for Qwen2 targets)
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
    embed_tokens.weight (only for heads with their own embedding)
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.drafters.eagle import EagleHead
from eyas.formats import ARCHITECTURES, hf_config_dict, save_tensors, write_json


def eagle1_config_json(
    head: EagleHead, target_name: str | None = None, dtype: torch.dtype | None = None
) -> dict:
    """config.json: the target's config with one layer plus ``bias`` (SafeAILab ea_model.py)."""
    cfg = hf_config_dict(head.config, dtype or head.fc.weight.dtype)
    cfg["architectures"] = [ARCHITECTURES.get(head.config.model_type, "LlamaForCausalLM")]
    cfg["num_hidden_layers"] = 1
    cfg["bias"] = head.fc.bias is not None  # SafeAILab ea_model.py: fc bias (defaults to true when absent)
    if target_name:
        cfg["eyas_target"] = target_name  # informational; engines ignore unknown keys
    return cfg


def save_eagle1(
    head: EagleHead, out_dir, target_name: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write ``head`` as config.json + model.safetensors in the SafeAILab EAGLE-1 layout.

    Keys are the head's own parameter names, which are the reference names
    (``eyas.drafters.eagle.EagleHead``). ``dtype`` casts float tensors (default: as they are).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v if dtype is None else v.to(dtype)) for k, v in head.state_dict().items()}
    save_tensors({k: v.cpu() for k, v in sd.items()}, out / "model.safetensors")
    write_json(out / "config.json", eagle1_config_json(head, target_name, dtype))
    return out


__all__ = ["save_eagle1", "eagle1_config_json"]
