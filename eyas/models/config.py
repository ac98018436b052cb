"""ModelConfig: the Llama-family hyper-parameters the native model needs.

Built from a Hugging Face ``config.json`` dict (Llama 2/3/3.1, Mistral, Qwen2,
Qwen3, SmolLM2). Architecture differences are flags here, not separate files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# model_type -> architecture flags that the HF config does not spell out
_ARCH_FLAGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF rope_scaling / rope_parameters dict; types supported: default, linear, llama3
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias only)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Map a transformers config dict onto ModelConfig."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _ARCH_FLAGS:
            raise ValueError(
                f"native model does not support model_type {model_type!r} "
                f"(supported: {', '.join(sorted(_ARCH_FLAGS))}); use --backend hf"
            )
        use_window = cfg.get("use_sliding_window", model_type == "mistral")
        window = cfg.get("sliding_window") if use_window else None
        if window is not None and window < cfg.get("max_position_embeddings", 4096):
            raise ValueError(
                f"native model does not implement sliding-window attention (sliding_window={window}); "
                "use --backend hf"
            )
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        bias = bool(cfg.get("attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, **_ARCH_FLAGS[model_type]}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
            **flags,
        )

    def inv_freq(self) -> torch.Tensor:
        """[Dh / 2] RoPE inverse frequencies, with rope scaling applied."""
        dim = self.head_dim
        # float32 like transformers, so native and HF RoPE tables agree bit for bit; on the CPU even inside a meta
        # build (torch's meta division imports torch._dynamo, ~1 s of a load)
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / self.rope_scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv, self.rope_scaling)
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent RoPE scaling (Meta's reference formula)."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
