"""``eyas convert SRC OUT --to LAYOUT [--verifier NAME_OR_DIR]``: move a head between layouts.

    eagle3        LlamaForCausalLMEagle3 directory (vLLM, SGLang, TensorRT-LLM)     eyas.formats.eagle3
    speculators   vllm-project/speculators directory (vLLM, speculators)            eyas.formats.speculators
    gguf          llama.cpp EAGLE-3 draft, one .gguf file                           eyas.formats.gguf_eagle3
    eagle1        SafeAILab EAGLE-1 directory (SafeAILab, SGLang)                   eyas.formats.eagle1
    eagle1-vllm   EAGLE-1 directory vLLM loads (no fc bias, ``bias: false``)        eyas.formats.eagle1
    medusa        FasterDecoding/Medusa heads (Medusa, TensorRT-LLM)                eyas.formats.medusa
    medusa-vllm   vLLM's MedusaModel heads                                          eyas.formats.medusa

SRC is any head eyas reads (a directory in one of these layouts, trained here or downloaded,
or an EAGLE-3 .gguf). The head is loaded for its target (``--verifier``, else the target the
source records: ``eyas_target``, speculators' verifier, Medusa's ``base_model_name_or_path``),
which also fills the output's verifier fields (``eyas.formats.verifier``). Tensors keep the
source's dtype unless ``--dtype`` says otherwise, so a conversion and its way back are exact.
What a target layout cannot express (an fc bias for vLLM's EAGLE-1, ``norm_before_residual``
for SGLang/TensorRT-LLM, an EAGLE-1 head as EAGLE-3) is refused with the reason.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.formats import read_config
from eyas.formats.verifier import Verifier, resolve_verifier

LAYOUTS = {  # target layout -> the head kind it holds
    "eagle3": "eagle3", "speculators": "eagle3", "gguf": "eagle3",
    "eagle1": "eagle1", "eagle1-vllm": "eagle1",
    "medusa": "medusa", "medusa-vllm": "medusa",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ConvertRequest:
    src: Path  # head directory or EAGLE-3 .gguf
    out: Path  # output directory (a .gguf file for --to gguf)
    to: str  # one of LAYOUTS
    verifier: str | None = None  # target model: eyas name, directory, .gguf or hub id; None: as recorded
    dtype: str | None = None  # float32 | bfloat16 | float16; None: the source's


@dataclass
class SourceHead:
    kind: str  # eagle3 | eagle1 | medusa
    head: torch.nn.Module  # Eagle3Head | EagleHead | MedusaHeads, float32
    dtype: torch.dtype  # float dtype of the source's weights
    verifier: Verifier  # the target it is loaded for
    target: str  # the target as named (eyas name, directory, .gguf or hub id), kept in eyas_target


def convert(req: ConvertRequest) -> Path:
    """Convert ``req.src`` to ``req.to``; returns what was written. ValueError/FileNotFoundError on bad input."""
    if req.to not in LAYOUTS:
        raise ValueError(f"unknown layout {req.to!r}; choose one of {', '.join(LAYOUTS)}")
    kind = source_kind(Path(req.src))
    if LAYOUTS[req.to] != kind:
        fits = ", ".join(k for k, v in LAYOUTS.items() if v == kind)
        raise ValueError(
            f"{req.src} holds an {_KIND_NAMES[kind]} head, which the {req.to!r} layout cannot hold "
            f"(it holds {_KIND_NAMES[LAYOUTS[req.to]]} heads); layouts for this head: {fits}"
        )
    if Path(req.out).resolve() == Path(req.src).resolve():
        raise ValueError(f"OUT {req.out} is the source itself: write the conversion somewhere else")
    src = load_source(Path(req.src), kind, req.verifier)
    dtype = DTYPES[req.dtype] if req.dtype else src.dtype
    out = _WRITERS[req.to](src, Path(req.out), dtype)
    if (Path(req.src) / "eyas.json").is_file() and out.is_dir():  # the recommended tree travels along
        shutil.copy(Path(req.src) / "eyas.json", out / "eyas.json")
    return out


_KIND_NAMES = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1", "medusa": "Medusa"}


# ---- reading the source ---------------------------------------------------------------------------
def source_kind(src: Path) -> str:
    """'eagle3', 'eagle1' or 'medusa' for a head directory or .gguf; ValueError for anything else."""
    from eyas.drafters.eagle import looks_like_eagle_dir
    from eyas.formats.eagle3 import looks_like_eagle3_dir
    from eyas.formats.gguf_eagle3 import is_eagle3_gguf
    from eyas.formats.medusa import looks_like_medusa_dir

    if not src.exists():
        raise FileNotFoundError(f"no such head: {src} (expected a head directory or an EAGLE-3 .gguf file)")
    if src.is_file():
        if is_eagle3_gguf(src):
            return "eagle3"
        raise ValueError(f"{src} is a file but not an EAGLE-3 GGUF: point at a head directory or a .gguf draft")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json: a head directory needs config.json next to its weights")
    _check_weights(src)
    for kind, looks in (("eagle3", looks_like_eagle3_dir), ("eagle1", looks_like_eagle_dir),
                        ("medusa", looks_like_medusa_dir)):
        if looks(src):
            return kind
    raise ValueError(
        f"{src} holds no head layout eyas knows: expected EAGLE-3 (midlayer.* / layers.0.* with d2t or "
        "hidden_norm), EAGLE-1 (fc.* + layers.0.*) or Medusa (blocks.* / K.J.linear.*) weights"
    )


def _check_weights(src: Path) -> None:
    """Weights exist and every safetensors file reads (a truncated or corrupt file is named)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files and not any(src.glob("*.bin")) and not any(src.glob("*.pt")):
        raise FileNotFoundError(f"{src} has no weights: expected model.safetensors (or pytorch_model.bin)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as h:
                h.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}): it may be truncated or corrupt") from None


def recorded_target(src: Path) -> str | None:
    """The target a head records: eyas_target, speculators' verifier, Medusa's base model."""
    if src.is_file():
        return None
    cfg = read_config(src)
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    return cfg.get("eyas_target") or verifier.get("name_or_path") or cfg.get("base_model_name_or_path") or None


def load_source(src: Path, kind: str, verifier: str | None) -> SourceHead:
    """Load the source head in float32 for its target (``verifier``, else the recorded one)."""
    name = verifier or recorded_target(src)
    if not name:
        raise ValueError(f"{src} does not record its target model: pass --verifier NAME_OR_DIR (the target)")
    ver = resolve_verifier(name)
    target_cfg = ver.model_config()
    if kind == "eagle3" and src.is_file():
        from eyas.formats.gguf_eagle3 import load_eagle3_gguf

        head = load_eagle3_gguf(src, target_cfg)
        return SourceHead(kind, head, _gguf_dtype(src), ver, name)
    if kind == "eagle3":
        from eyas.formats.eagle3 import load_eagle3

        head = load_eagle3(src, target_cfg)
    elif kind == "eagle1":
        from eyas.drafters.eagle import load_eagle_head

        head = load_eagle_head(src, target_cfg, torch.float32)
    else:
        from eyas.formats.medusa import load_medusa

        head = load_medusa(src, target_cfg)
    return SourceHead(kind, head, _weights_dtype(src), ver, name)


def _weights_dtype(src: Path) -> torch.dtype:
    """The dtype of the source's floating-point tensors (the most common one)."""
    from eyas.formats import read_weights

    counts: dict[torch.dtype, int] = {}
    for t in read_weights(src).values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _gguf_dtype(src: Path) -> torch.dtype:
    from gguf import GGUFReader

    field = GGUFReader(str(src)).fields.get("general.file_type")
    return {1: torch.float16, 32: torch.bfloat16}.get(field.contents() if field else 0, torch.float32)


# ---- writing --------------------------------------------------------------------------------------
def _eagle3(src: SourceHead, out: Path, dtype: torch.dtype) -> Path:
    from eyas.formats.eagle3 import save_eagle3

    return save_eagle3(src.head, out, target_name=src.target, dtype=dtype)


def _speculators(src: SourceHead, out: Path, dtype: torch.dtype) -> Path:
    from eyas.formats.eagle3 import save_eagle3

    return save_eagle3(src.head, out, dtype=dtype, speculators=True, verifier=src.verifier)


def _gguf(src: SourceHead, out: Path, dtype: torch.dtype) -> Path:
    from eyas.formats.gguf_eagle3 import save_eagle3_gguf

    if out.suffix != ".gguf":
        raise ValueError(f"--to gguf writes one file: give OUT a .gguf name, not {out}")
    if src.verifier.gguf is None:
        raise ValueError(
            f"llama.cpp checks the draft's vocabulary against its target's, and the verifier "
            f"{src.verifier.name_or_path!r} has no GGUF to copy it from: pass --verifier TARGET.gguf "
            "(the target converted with llama.cpp's convert_hf_to_gguf.py)"
        )
    return save_eagle3_gguf(src.head, out, vocab_from=src.verifier.gguf, dtype=dtype,
                            name=f"EAGLE-3 draft for {src.verifier.name_or_path}")


def _eagle1(layout: str):
    def write(src: SourceHead, out: Path, dtype: torch.dtype) -> Path:
        from eyas.formats.eagle1 import save_eagle1

        return save_eagle1(src.head, out, target_name=src.target, dtype=dtype, layout=layout)

    return write


def _medusa(layout: str):
    def write(src: SourceHead, out: Path, dtype: torch.dtype) -> Path:
        from eyas.formats.medusa import save_medusa

        # base_model_name_or_path: what Medusa's MedusaModel.from_pretrained and TensorRT-LLM's
        # convert_checkpoint.py (--model_dir) load the base model from
        return save_medusa(src.head.to(dtype), out, layout=layout, target_name=src.verifier.name_or_path)

    return write


_WRITERS = {
    "eagle3": _eagle3, "speculators": _speculators, "gguf": _gguf,
    "eagle1": _eagle1("safeailab"), "eagle1-vllm": _eagle1("vllm"),
    "medusa": _medusa("medusa"), "medusa-vllm": _medusa("vllm"),
}


# ---- command line ---------------------------------------------------------------------------------
def add_convert_parser(sub) -> None:
    """``eyas convert`` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="convert a drafter head between engine layouts (vLLM, SGLang, "
                       "TensorRT-LLM, llama.cpp, speculators, Medusa)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])
    p.add_argument("src", help="head directory (any layout eyas reads) or EAGLE-3 .gguf")
    p.add_argument("out", help="output directory (a .gguf file for --to gguf)")
    p.add_argument("--to", required=True, metavar="LAYOUT", help="one of: " + ", ".join(LAYOUTS))
    p.add_argument("--verifier", default=None, metavar="NAME_OR_DIR",
                   help="the head's target model: 'embedded', a model directory, a .gguf or a hub id in the "
                        "local cache (default: the target the source records)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="tensor dtype (default: the source's)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(a: argparse.Namespace) -> int:
    out = convert(ConvertRequest(Path(a.src), Path(a.out), a.to, a.verifier, a.dtype))
    print(json.dumps({"written": str(out), "layout": a.to}))
    return 0


__all__ = ["LAYOUTS", "ConvertRequest", "convert", "source_kind", "load_source", "add_convert_parser"]
