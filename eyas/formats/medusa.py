"""Medusa heads' checkpoint layouts <-> eyas.drafters.medusa.MedusaHeads (safetensors only).

* ``medusa`` -- FasterDecoding/Medusa ``medusa/model/medusa_model.py``: ``medusa_head`` is an
  ``nn.ModuleList`` of ``nn.Sequential(ResBlock x L, nn.Linear(D, V, bias=False))`` and
  ``ResBlock.linear`` has a bias, so its state dict keys are ``{k}.{j}.linear.weight``,
  ``{k}.{j}.linear.bias`` and ``{k}.{L}.weight``; ``config.json`` holds ``medusa_num_heads``,
  ``medusa_num_layers`` and ``base_model_name_or_path``. The reference pickles the weights to
  ``medusa_lm_head.pt``; its later training scripts and TGI use ``medusa_lm_head.safetensors``,
  the name written here.
* ``vllm`` -- vLLM ``vllm/model_executor/models/medusa.py``: ``blocks.{k}.layers.{j}.weight``
  (``.bias`` only when config ``medusa_fc_bias`` is true; vLLM's default is no bias) and
  ``lm_heads.{k}.weight``; ``config.json`` read by ``vllm/transformers_utils/configs/medusa.py``
  (``model_type`` "medusa", ``architectures`` ["MedusaModel"], ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``). The
  heads (MedusaHeads) use vLLM's names, so that layout is their own state dict.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from eyas.drafters.eagle import HeadMismatchError
from eyas.drafters.medusa import MedusaConfig, MedusaHeads
from eyas.models.config import ModelConfig

LAYOUTS = ("vllm", "medusa")
_WEIGHT_FILES = {"vllm": "model.safetensors", "medusa": "medusa_lm_head.safetensors"}
# vLLM's load_weights strips "medusa_heads."; Medusa-2 full-model checkpoints nest the heads
# under "medusa_head." (MedusaModelABC.medusa_head)
_PREFIXES = ("medusa_heads.", "medusa_head.")
_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")


def save_medusa(heads: MedusaHeads, out_dir: str | Path, layout: str = "vllm", target_name: str = "") -> Path:
    """Write config.json + safetensors weights in the ``vllm`` or ``medusa`` layout; returns the dir."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Medusa layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    c = heads.config
    sd = {k: v.detach().cpu().contiguous().clone() for k, v in heads.state_dict().items()}
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    if layout == "vllm":
        # vLLM's MedusaConfig.from_pretrained renames every key holding "num" and "heads" to
        # num_heads (and "num" + "layers" to num_hidden_layers): write no other such key.
        cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
               "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
               "truncated_vocab_size": c.vocab_size, "medusa_fc_bias": c.bias, "original_lm_head": False,
               "base_model_name_or_path": target_name, "torch_dtype": dtype}
    else:
        sd = _to_medusa_keys(sd, c)
        # MedusaConfig (FasterDecoding) fields; hidden_size / vocab_size are extra PretrainedConfig
        # kwargs it keeps and eyas checks against the target
        cfg = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
               "base_model_name_or_path": target_name, "hidden_size": c.hidden_size,
               "vocab_size": c.vocab_size, "torch_dtype": dtype}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / _WEIGHT_FILES[layout]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _to_medusa_keys(sd: dict[str, torch.Tensor], c: MedusaConfig) -> dict[str, torch.Tensor]:
    """vLLM names -> Medusa names (nn.Sequential indices; the lm_head is entry num_layers)."""
    out = {}
    for k in range(c.num_heads):
        for j in range(c.num_layers):
            w = sd[f"blocks.{k}.layers.{j}.weight"]
            out[f"{k}.{j}.linear.weight"] = w
            # Medusa's ResBlock always has a bias: a bias-free block is the same block with b = 0
            out[f"{k}.{j}.linear.bias"] = sd.get(f"blocks.{k}.layers.{j}.bias", w.new_zeros(w.shape[0]))
        out[f"{k}.{c.num_layers}.weight"] = sd[f"lm_heads.{k}.weight"]
    return out


def detect_layout(keys) -> str | None:
    """'vllm', 'medusa' or None for a collection of state dict keys (prefixes stripped)."""
    keys = [_strip(k) for k in keys]
    if keys and all(k.startswith(("blocks.", "lm_heads.")) or k == "token_map" for k in keys):
        return "vllm"
    if keys and all(_MEDUSA_KEY.match(k) for k in keys):
        return "medusa"
    return None


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def _weights_path(p: Path) -> Path:
    for name in _WEIGHT_FILES.values():
        if (p / name).exists():
            return p / name
    for name in ("medusa_lm_head.pt", "pytorch_model.bin"):
        if (p / name).exists():
            src, dst = p / name, p / _WEIGHT_FILES["medusa"]
            raise ValueError(
                f"{src} is a pickle checkpoint and eyas reads safetensors only; convert it once with: "
                f"python -c \"import torch; from safetensors.torch import save_file; "
                f"sd = torch.load('{src}', weights_only=True); "
                f"save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, '{dst}')\""
            )
    raise FileNotFoundError(f"no {' or '.join(_WEIGHT_FILES.values())} in {p}")


def looks_like_medusa_dir(path: str | Path) -> bool:
    """True for a directory holding Medusa heads in either layout (reads key names only)."""
    p = Path(path)
    if not p.is_dir():
        return False
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    if isinstance(raw, dict) and (raw.get("model_type") == "medusa" or "medusa_num_heads" in raw):
        return True
    files = [p / n for n in _WEIGHT_FILES.values() if (p / n).exists()]
    if not files:
        return False
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:  # key names only, no tensor reads
        return detect_layout(list(f.keys())) is not None


def load_medusa(path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Load heads in either layout and check they fit the target (HeadMismatchError if not)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"Medusa heads {p} need a config.json next to the weights")
    raw = json.loads((p / "config.json").read_text())
    sd = {_strip(k): v for k, v in load_file(str(_weights_path(p))).items()}
    layout = detect_layout(sd)
    if layout is None:
        raise HeadMismatchError(
            f"{p} holds no Medusa heads: expected keys blocks.K.layers.J.* + lm_heads.K.weight (vLLM) "
            f"or K.J.linear.* + K.L.weight (Medusa); found e.g. {sorted(sd)[:4]}"
        )
    sd, cfg = _from_vllm(sd, raw, p) if layout == "vllm" else _from_medusa(sd, raw, p)
    _check_fits(cfg, raw, target_cfg, p)
    heads = MedusaHeads(cfg)
    try:
        heads.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise HeadMismatchError(f"Medusa heads {p}: weights do not match their config: {e}") from None
    return heads.to(dtype).eval().requires_grad_(False)


def _config_count(raw: dict, names: tuple[str, ...], found: int, what: str, p: Path) -> int:
    """The config's head/layer count (both references build that many; extra weights are ignored)."""
    n = next((raw[k] for k in names if k in raw), found)
    if not isinstance(n, int) or not 1 <= n <= found:
        raise HeadMismatchError(
            f"Medusa heads {p}: config.json asks for {n} {what} but the weights hold {found}; "
            f"fix {names[0]} in config.json"
        )
    return n


def _from_vllm(sd: dict, raw: dict, p: Path) -> tuple[dict, MedusaConfig]:
    tv = raw.get("truncated_vocab_size")
    if "token_map" in sd or (tv is not None and tv != raw.get("vocab_size", tv)):
        raise HeadMismatchError(
            f"Medusa heads {p} draft in a truncated vocabulary (token_map); eyas needs heads over the "
            f"target's full vocabulary: export them without truncated_vocab_size / token_map"
        )
    found = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    if raw.get("original_lm_head", False) and "lm_heads.0.weight" in sd:
        # vLLM: one lm_head (stored as lm_heads.0) shared by every head
        sd = sd | {f"lm_heads.{k}.weight": sd["lm_heads.0.weight"] for k in range(found)}
    n = _config_count(raw, ("num_heads", "medusa_num_heads"), found, "heads", p)
    layers = len({k.split(".")[3] for k in sd if k.startswith("blocks.0.layers.")})
    nl = _config_count(raw, ("num_hidden_layers", "medusa_num_layers"), layers, "layers per head", p)

    def kept(key: str) -> bool:  # both references build the config's counts and skip the rest
        parts = key.split(".")
        return int(parts[1]) < n and (parts[0] == "lm_heads" or int(parts[3]) < nl)

    sd = {k: v for k, v in sd.items() if kept(k)}
    if "lm_heads.0.weight" not in sd:
        raise HeadMismatchError(f"Medusa heads {p}: no lm_heads.0.weight in the weights")
    v, d = sd["lm_heads.0.weight"].shape
    # the weights decide the bias (vLLM itself would drop biases unless config medusa_fc_bias is true)
    return sd, MedusaConfig(d, v, n, nl, bias="blocks.0.layers.0.bias" in sd)


def _from_medusa(sd: dict, raw: dict, p: Path) -> tuple[dict, MedusaConfig]:
    found = len({k.split(".")[0] for k in sd})
    n = _config_count(raw, ("medusa_num_heads", "num_heads"), found, "heads", p)
    lm_idx = [int(k.split(".")[1]) for k in sd if k.startswith("0.") and ".linear." not in k]
    if len(lm_idx) != 1:
        raise HeadMismatchError(f"Medusa heads {p}: head 0 needs exactly one lm_head key '0.L.weight'")
    nl = _config_count(raw, ("medusa_num_layers", "num_hidden_layers"), lm_idx[0], "layers per head", p)
    out = {}
    try:
        for k in range(n):
            for j in range(nl):
                out[f"blocks.{k}.layers.{j}.weight"] = sd[f"{k}.{j}.linear.weight"]
                out[f"blocks.{k}.layers.{j}.bias"] = sd[f"{k}.{j}.linear.bias"]
            out[f"lm_heads.{k}.weight"] = sd[f"{k}.{nl}.weight"]
    except KeyError as e:
        raise HeadMismatchError(f"Medusa heads {p}: missing key {e.args[0]} (config: {n} heads, "
                                f"{nl} layers each)") from None
    v, d = out["lm_heads.0.weight"].shape
    return out, MedusaConfig(d, v, n, nl, bias=True)


def _check_fits(cfg: MedusaConfig, raw: dict, target_cfg: ModelConfig, p: Path) -> None:
    base = raw.get("base_model_name_or_path") or "unknown"
    for name, ours, theirs in (("hidden size", cfg.hidden_size, target_cfg.hidden_size),
                               ("vocabulary size", cfg.vocab_size, target_cfg.vocab_size)):
        if ours != theirs:
            raise HeadMismatchError(
                f"Medusa heads {p} have {name} {ours} but the target's {name} is {theirs}: these heads "
                f"were trained for a different target model (base_model_name_or_path: {base}); "
                f"use heads trained for this target"
            )
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if key in raw and raw[key] != ours:
            raise HeadMismatchError(f"Medusa heads {p}: config.json {key}={raw[key]}, weights {ours}")
