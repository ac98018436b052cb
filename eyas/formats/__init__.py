"""Checkpoint layouts that other engines read and write, mapped onto eyas heads.

    eagle1       SafeAILab EAGLE-1 heads (``fc`` + ``layers.0.*``), and the variant vLLM loads
    eagle3       EAGLE-3 heads in the ``LlamaForCausalLMEagle3`` layout (vLLM, SGLang, TensorRT-LLM)
    speculators  the vllm-project/speculators ``Eagle3Speculator`` config and key names
    gguf_eagle3  EAGLE-3 heads as llama.cpp ``eagle3`` draft GGUF files
    verifier     the target model an export names (hub id or directory, real architectures)
    convert      ``eyas convert``: any head eyas reads -> any of these layouts (and Medusa's two)

This module holds what they share: reading weights (safetensors, or
``torch.load(weights_only=True)`` for a ``pytorch_model.bin``), listing key names
without reading tensors, and turning a ``ModelConfig`` into a transformers-style
config dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.models.config import ModelConfig

# model_type -> the transformers architecture name of a full model of that family
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _safetensors_files(p: Path) -> list[Path]:
    """model.safetensors, else every *.safetensors shard of the directory."""
    single = p / "model.safetensors"
    return [single] if single.exists() else sorted(p.glob("*.safetensors"))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head directory: model.safetensors (or its shards), else pytorch_model.bin."""
    from safetensors.torch import load_file

    p = Path(path)
    files = _safetensors_files(p)
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    if (p / "pytorch_model.bin").exists():
        return torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"no model.safetensors or pytorch_model.bin in {p}: point at the head's directory"
    )


def weight_keys(path: Path) -> set[str]:
    """Key names of a head directory's weights, reading no tensor data (empty if there are none)."""
    p = Path(path)
    files = _safetensors_files(p)
    if files:
        from safetensors import safe_open

        keys: set[str] = set()
        for f in files:
            with safe_open(str(f), "pt") as h:
                keys.update(h.keys())
        return keys
    if (p / "pytorch_model.bin").exists():
        # mmap: only the pickle's index is read, not the tensor storage
        return set(torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True))
    return set()


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(
            f"no config.json in {path}: a head directory needs config.json next to its weights"
        )
    return json.loads(f.read_text())


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_tensors(sd: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file with ``format: pt`` metadata (transformers' from_pretrained insists on it)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().clone() for k, v in sd.items()}, str(path), metadata={"format": "pt"}
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """A transformers-style config dict that ``ModelConfig.from_hf`` maps back onto ``cfg``."""
    rope = {k: v for k, v in cfg.rope_scaling.items() if k != "rope_theta"}
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope if kind != "default" else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        # one flag for q/k/v and o_proj in Llama; Qwen2 adds q/k/v bias through its model_type
        "attention_bias": cfg.o_bias,
        "mlp_bias": False,
    }
    if dtype is not None:
        out["torch_dtype"] = dtype_name(dtype)
    return out


__all__ = [
    "ARCHITECTURES",
    "read_weights",
    "weight_keys",
    "read_config",
    "write_json",
    "save_tensors",
    "dtype_name",
    "hf_config_dict",
]
