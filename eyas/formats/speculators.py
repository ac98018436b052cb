"""The vllm-project/speculators layout for EAGLE-3 heads (``Eagle3Speculator``).

vLLM loads it directly (``vllm serve <dir>`` even picks the verifier and the
number of speculative tokens from it), and the speculators library trains and
converts into it. Compared with the ``LlamaForCausalLMEagle3`` layout of
``eyas.formats.eagle3`` it differs in two ways:

* **config.json** is the speculators schema (speculators ``src/speculators/config.py``
  ``SpeculatorModelConfig`` / ``SpeculatorsConfig`` / ``VerifierConfig``, and
  ``src/speculators/models/eagle3/config.py`` ``Eagle3SpeculatorConfig``): the
  decoder layer's LlamaConfig sits under ``transformer_layer_config``; next to it
  ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (algorithm,
  proposal_methods, default_proposal_method, verifier).
* **weight keys** use ``layers.0.*`` where the other layout has ``midlayer.*``:
  speculators' ``Eagle3DraftModel`` keeps its decoder layers in ``self.layers``
  (``src/speculators/models/eagle3/core.py``) and its converter remaps
  ``midlayer.*`` to ``layers.0.*`` (tests of ``Eagle3Converter``: "Weight
  remapping from midlayer.* to layers.0.*"). vLLM (``llama_eagle3.py``
  ``load_weights`` renames ``midlayer.`` to ``layers.0.``) and TensorRT-LLM
  (``modeling_speculative.py`` ``Eagle3ForCausalLM.load_weights`` maps
  ``layers.0.`` to ``midlayer.``) read either name; SGLang's
  ``llama_eagle3.py`` reads only ``midlayer.*`` and skips unknown keys silently,
  so a speculators directory is for vLLM and speculators, not SGLang.

``norm_before_residual`` is written explicitly as ``false``: vLLM's speculators
adapter defaults it to **true** when absent
(``vllm/transformers_utils/configs/speculators/algos.py`` ``update_eagle3``), and
eyas's ``Eagle3Layer`` adds the raw hidden input as the residual.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.drafters.eagle import HeadMismatchError
from eyas.formats import hf_config_dict, write_json
from eyas.formats.verifier import Verifier

# decoder-layer key prefix of speculators' Eagle3DraftModel (src/speculators/models/eagle3/core.py)
SPECULATORS_LAYER_PREFIX = "layers.0."
# decoder-layer families that are the layer eyas's Eagle3Head computes (Mistral's layer is Llama's)
LLAMA_LAYER_TYPES = ("llama", "mistral")
# vLLM's default when a speculators config omits the key (configs/speculators/algos.py update_eagle3)
VLLM_NORM_BEFORE_RESIDUAL_DEFAULT = True


def is_speculators_config(cfg: dict) -> bool:
    """Whether a config.json dict is in the speculators schema (vLLM checks the same key)."""
    return "speculators_model_type" in cfg


def speculators_config_json(
    head_cfg,
    verifier: Verifier | None,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
) -> dict:
    """The speculators config.json of an ``Eagle3Config`` (see the module docstring for sources).

    ``verifier`` (``eyas.formats.verifier.resolve_verifier``) supplies ``name_or_path`` (a hub id or an
    absolute directory, which speculators' ``from_pretrained`` resolves with ``AutoConfig``) and the
    target's own ``architectures``; None writes ``null`` and ``[]`` (speculators' VerifierConfig
    allows both; vLLM then needs ``--model``).
    """
    layer = hf_config_dict(head_cfg.model, dtype)
    # the layer is a Llama decoder layer whatever the target family (vLLM builds
    # Eagle3LlamaForCausalLM from it; speculators' converter writes a LlamaConfig)
    layer.update(model_type="llama", num_hidden_layers=head_cfg.model.num_layers, tie_word_embeddings=False)
    return {
        "architectures": ["Eagle3Speculator"],  # Eagle3SpeculatorConfig.architectures default
        "speculators_model_type": "eagle3",  # vLLM: SUPPORTED_SPECULATORS_TYPES key
        "transformer_layer_config": layer,  # vLLM: the draft model's hf_config
        "draft_vocab_size": head_cfg.draft_vocab_size,
        # explicit: vLLM defaults to True when absent (module docstring)
        "norm_before_residual": bool(getattr(head_cfg, "norm_before_residual", False)),
        "target_hidden_size": head_cfg.target_hidden_size,
        # vLLM convention (id i = residual entering target layer i), as eyas's aux_layers
        "eagle_aux_hidden_state_layer_ids": list(head_cfg.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            # vLLM reads proposal_methods[0]["speculative_tokens"] (configs/speculators/base.py)
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            # vLLM requires verifier.name_or_path to exist (validate_speculators_config)
            "verifier": {
                "name_or_path": verifier.name_or_path if verifier else None,
                "architectures": list(verifier.architectures) if verifier else [],
            },
        },
        "torch_dtype": layer["torch_dtype"],
    }


def write_speculators_config(
    head_cfg,
    out_dir,
    verifier: Verifier | None = None,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
) -> dict:
    """Write ``out_dir/config.json`` in the speculators schema; returns the dict written.

    Weights for this config use ``layers.0.*`` keys (``SPECULATORS_LAYER_PREFIX``);
    ``eyas.formats.eagle3.save_eagle3(..., speculators=True)`` writes both.
    """
    cfg = speculators_config_json(head_cfg, verifier, dtype, speculative_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", cfg)
    return cfg


def flatten_speculators_config(cfg: dict) -> dict:
    """Speculators config.json -> the flat LlamaForCausalLMEagle3-style dict eyas reads.

    Mirrors what vLLM does (``SpeculatorsConfig.extract_transformers_pre_trained_config``
    + ``update_eagle3``), including its default ``norm_before_residual = True``.
    """
    if cfg.get("speculators_model_type") != "eagle3":
        raise HeadMismatchError(
            f"speculators model type {cfg.get('speculators_model_type')!r} is not an EAGLE-3 head "
            "(expected speculators_model_type 'eagle3')"
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadMismatchError(
            "speculators config has no transformer_layer_config dict: not a valid speculators head"
        )
    kind = layer.get("model_type", "llama")
    if kind not in LLAMA_LAYER_TYPES:
        # speculators builds the first layer of this family (models/eagle3/model_definitions.py
        # model_classes: llama, qwen3 with q/k norms); eyas's Eagle3Head computes a Llama layer only
        raise HeadMismatchError(
            f"speculators EAGLE-3 head with a {kind!r} decoder layer (transformer_layer_config.model_type): "
            f"eyas's Eagle3Head computes a dense Llama layer only ({' or '.join(LLAMA_LAYER_TYPES)}), so "
            "this architecture is not supported"
        )
    flat = dict(layer)
    flat["draft_vocab_size"] = cfg.get("draft_vocab_size")
    flat["norm_before_residual"] = cfg.get("norm_before_residual", VLLM_NORM_BEFORE_RESIDUAL_DEFAULT)
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc"):
        if cfg.get(key) is not None:
            flat[key] = cfg[key]
    return flat


__all__ = ["SPECULATORS_LAYER_PREFIX", "is_speculators_config", "speculators_config_json",
           "write_speculators_config", "flatten_speculators_config"]
