"""The verifier (target model) an exported head names, resolved to something the engines can load.

Exports record their target so an engine can pair head and model: speculators'
``speculators_config.verifier`` (``name_or_path`` + ``architectures``), Medusa's
``base_model_name_or_path``, and the GGUF vocabulary llama.cpp checks against the target's.
eyas's own target names are not all such things: ``embedded:smollm2-135m-instruct`` is a
GGUF inside a PyPI package, and a relative path means nothing elsewhere. ``resolve_verifier``
turns any ``--model`` / ``--verifier`` value into:

* ``name_or_path``: a hub id or an absolute local directory, what speculators'
  ``from_pretrained`` passes to ``AutoConfig.from_pretrained`` (speculators 0.9.0
  ``models/utils.py`` ``resolve_target_layer_ids``, ``model.py`` ``load_verifier_weights``)
  and ``vllm serve`` reads (vLLM ``configs/speculators/base.py``). The embedded model becomes
  the hub id of the model it quantises, ``HuggingFaceTB/SmolLM2-135M-Instruct``; a GGUF file
  becomes the HF directory eyas dequantised it into (``models.loading.gguf_to_dir``).
* ``architectures``: the target's own ``config.json`` ``architectures`` (a Qwen3 target gives
  ``Qwen3ForCausalLM``), never guessed from the head, whose layer is always a Llama layer.
* ``config_dir``: a local directory with the target's config.json (eyas reads the target's
  shape from it to check a head), or None for a hub id that is not in the local HF cache.
* ``gguf``: the target's GGUF file when there is one (llama.cpp drafts copy its vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.formats import ARCHITECTURES
from eyas.models.config import ModelConfig

# eyas target names -> the hub id of the model they are (the embedded GGUF is a Q4_1 quantisation of it)
EMBEDDED_HUB_IDS = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
EMBEDDED_ALIASES = ("embedded", "default", "smollm2-135m-instruct")


class VerifierError(ValueError):
    """A verifier name that cannot be resolved; the message says what to pass instead."""


@dataclass
class Verifier:
    name_or_path: str  # hub id or absolute local directory (what engines and speculators load)
    architectures: list[str] = field(default_factory=list)  # the target's config.json architectures
    config_dir: Path | None = None  # local directory holding the target's config.json
    gguf: Path | None = None  # the target's GGUF file, when it has one

    def model_config(self) -> ModelConfig:
        """The target's shape (what head loaders check a head against)."""
        if self.config_dir is None:
            raise VerifierError(
                f"the verifier {self.name_or_path!r} is not available locally, so its shape cannot be "
                "read: pass --verifier with a local model directory (or download it first)"
            )
        return ModelConfig.from_hf(_read_config(self.config_dir))


def _read_config(d: Path) -> dict:
    raw = json.loads((d / "config.json").read_text())
    return {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw


def _architectures(d: Path, name: str) -> list[str]:
    """config.json ``architectures``; a config without them (eyas's dequantised GGUF) by its family."""
    cfg = json.loads((d / "config.json").read_text())
    archs = cfg.get("architectures") or (
        [ARCHITECTURES[cfg["model_type"]]] if cfg.get("model_type") in ARCHITECTURES else None
    )
    if not archs:
        raise VerifierError(f"the verifier {name!r} names no 'architectures' in {d / 'config.json'}")
    return list(archs)


def resolve_verifier(spec: str | None) -> Verifier:
    """A ``--model`` / ``--verifier`` value (embedded name, directory, .gguf, hub id) -> Verifier."""
    from eyas.models.loading import DEFAULT_MODEL, embedded_gguf_path, gguf_to_dir

    if spec is None or spec == "":
        raise VerifierError("no verifier given: pass --verifier NAME_OR_DIR (the target model of the head)")
    if spec in EMBEDDED_HUB_IDS or spec in EMBEDDED_ALIASES:
        gguf = embedded_gguf_path()
        d = gguf_to_dir(gguf)
        return Verifier(EMBEDDED_HUB_IDS[DEFAULT_MODEL], _architectures(d, spec), d, gguf)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        d = gguf_to_dir(p)
        return Verifier(str(d.resolve()), _architectures(d, spec), d, p.resolve())
    if p.is_dir():
        if not (p / "config.json").exists():
            raise VerifierError(f"verifier directory {p} has no config.json: point at the target model's folder")
        return Verifier(str(p.resolve()), _architectures(p, spec), p.resolve())
    if p.exists() or spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise VerifierError(
            f"verifier {spec!r} is neither a model directory, a .gguf file nor a hub id (org/name)"
        )
    return _hub_verifier(spec)


def _hub_verifier(repo: str) -> Verifier:
    """A hub id, read from the local HF cache only (exports never download a model)."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo, "config.json")
    if not isinstance(cached, str) and repo in EMBEDDED_HUB_IDS.values():
        return resolve_verifier("embedded")  # the embedded GGUF is this model, quantised
    if not isinstance(cached, str):
        raise VerifierError(
            f"verifier {repo!r} is not in the local Hugging Face cache, so its architectures cannot be "
            "read: download it (huggingface-cli download REPO config.json) or pass its local directory"
        )
    d = Path(cached).parent
    return Verifier(repo, _architectures(d, repo), d)


__all__ = ["Verifier", "VerifierError", "resolve_verifier", "EMBEDDED_HUB_IDS"]
