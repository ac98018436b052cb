"""Checks of an EAGLE-3 head's config.json and weights against what eyas's Eagle3Head computes and the target it
drafts for (eyas.formats.eagle3 reads heads through them): each names the problem and the fix.
"""

from __future__ import annotations

import torch

from eyas.drafters.eagle import HeadMismatchError
from eyas.models.config import ModelConfig

EXTRA_PREFIX = "extra_layers."  # Eagle3Head's decoder layers after the first (layers.1. .. in the files)
# options some trainers set that eyas's Eagle3Head does not implement:
# norm_before_fc / fc_norm / eh_proj_before_attn / return_hidden_post_norm (TRT-LLM
# Eagle3DraftModel eagle_config), norm_output (TRT-LLM), norm_before_fc (speculators, gpt-oss)
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "eh_proj_before_attn", "return_hidden_post_norm",
                      "norm_output")


def layer_count(cfg: dict, sd: dict[str, torch.Tensor], where) -> int:
    """Decoder layers in the weights (``midlayer`` and ``extra_layers.0`` ..), checked against num_hidden_layers."""
    extra = {int(k[len(EXTRA_PREFIX) :].split(".", 1)[0]) for k in sd if k.startswith(EXTRA_PREFIX)}
    n = 1 + len(extra)
    if extra != set(range(len(extra))):
        raise HeadMismatchError(f"EAGLE-3 head {where}: its decoder layers after the first are numbered "
                                f"{sorted(j + 1 for j in extra)}, not 1 .. {len(extra)}")
    said = cfg.get("num_hidden_layers", 1)
    if said != n:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: config.json says num_hidden_layers {said} but the weights hold {n} decoder "
            f"layer{'s' if n > 1 else ''} (midlayer.*{', layers.1.* ..' if n > 1 else ''}): fix num_hidden_layers"
        )
    return n


def check_options(cfg: dict, where) -> dict:
    """Reject layer variants Eagle3Head does not compute; returns extra Eagle3Config fields."""
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} sets use_aux_hidden_state=false (no fc fusion); eyas's "
            "Eagle3Head always fuses the target's aux layers"
        )
    flags = [k for k in _UNSUPPORTED_FLAGS if cfg.get(k) or eagle.get(k)]
    if flags:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} sets {', '.join(flags)}, which eyas's Eagle3Head does not "
            "implement: retrain without it or extend eyas.drafters.eagle3"
        )
    # vLLM llama_eagle3.py: residual = hidden_norm(hidden) instead of the raw hidden when true
    return {"norm_before_residual": bool(cfg.get("norm_before_residual", False))}


def check_dense_layer(sd: dict[str, torch.Tensor], where) -> None:
    """Refuse a mixture-of-experts draft layer before loading it (its keys are not a Llama MLP's)."""
    moe = sorted(k for k in sd if ".experts." in k or ".router." in k or k.endswith("mlp.gate.weight"))
    if moe:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: its decoder layer is a mixture of experts (e.g. {moe[0]}); eyas's "
            "Eagle3Head computes a dense Llama layer only, so this architecture is not supported"
        )


def check_fc(fc: torch.Tensor, aux: tuple[int, ...], cfg: dict, target_cfg: ModelConfig, where) -> None:
    d, n = fc.shape
    k, h = len(aux), target_cfg.hidden_size
    # the target hidden size the head was trained for (engines: target_hidden_size, else hidden_size)
    trained = cfg.get("target_hidden_size") or cfg.get("hidden_size") or n // k
    if trained != h or n % h:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} fuses features of hidden size {trained} (fc.weight "
            f"{tuple(fc.shape)}) but the target's hidden size is {h}: this head was trained "
            "for a different target model"
        )
    if n != k * h:
        raise HeadMismatchError(
            f"EAGLE-3 head {where}: config.json lists {k} aux layers {list(aux)} but fc.weight "
            f"{tuple(fc.shape)} fuses {n // h} target features: fix "
            "eagle_aux_hidden_state_layer_ids"
        )
    if d != h:
        raise HeadMismatchError(
            f"EAGLE-3 head {where} has hidden size {d} but the target's hidden size is {h}; "
            "eyas's Eagle3Head embeds with the target's embedding, so they must be equal"
        )


def check_aux(aux: tuple[int, ...], target_cfg: ModelConfig, where) -> None:
    n = target_cfg.num_layers
    if any(not 0 <= i < n for i in aux):
        raise HeadMismatchError(
            f"EAGLE-3 head {where} reads target layers {list(aux)} but the target has {n} "
            f"layers (ids 0..{n - 1}): this head was trained for a different (deeper) target"
        )
