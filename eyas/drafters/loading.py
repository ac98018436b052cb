"""Turn a --drafter value into a Drafter: none, a registered name, or a path.

A path is inspected: a directory with an EAGLE head (``fc.*`` + ``layers.0.*``
keys) becomes the ``eagle`` drafter; a directory holding a full causal LM that
shares the target's tokenizer becomes the ``draft`` (small LM) drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# importing the modules registers their drafters
from eyas.drafters import draft_lm, eagle, eagle3, medusa, ngram  # noqa: F401
from eyas.drafters.base import Drafter, drafter_names, get_drafter_factory


class DrafterLoadError(ValueError):
    """A drafter could not be built; the message says how to fix it."""


@dataclass
class DrafterSpec:
    name: str = "default"  # none | default | a registered name | a path
    tree: str | None = None  # static[:PRESET or choices] | dynamic | chain
    options: dict = field(default_factory=dict)


# heads trained by eyas that are the *default* drafter of a target: target name -> directory under
# eyas/heads. The SmolLM2 head (docs/heads.md) drafts losslessly and beats prompt lookup on MT-bench in
# dtype auto on both CPU kinds measured (bf16 on AVX512-BF16: 0.99x plain vs ngram's 0.84x; fp32 on
# AVX2: 0.89x vs 0.88x), so it is the embedded model's default; `--drafter ngram` stays one flag away.
SHIPPED_HEADS: dict[str, str] = {"embedded:smollm2-135m-instruct": "smollm2-135m-instruct-eagle3"}


def shipped_head(target_name: str) -> Path | None:
    """The shipped head for a target, if any (see docs/heads.md for how it was trained)."""
    sub = SHIPPED_HEADS.get(target_name)
    if sub is None:
        return None
    p = Path(__file__).resolve().parents[1] / "heads" / sub
    return p if (p / "config.json").exists() else None


def default_drafter_name(target) -> str:
    """The drafter used when none is named: for a target with a shipped head, ``hybrid`` (the head's dynamic
    tree and prompt lookup in one tree; on MT-Bench-101 tuning questions, bf16 exact, AVX512-BF16 VM: 1.30x
    over plain at tau 1.95, the head alone 1.16x at tau 1.38, docs/benchmarks.md), else prompt lookup.
    """
    head = shipped_head(getattr(target, "name", ""))
    return "hybrid" if head is not None else "ngram"


HEAD_KINDS = ("eagle3", "eagle", "medusa")  # drafters that read a head directory (detect_kind's names)


def build_drafter(spec: DrafterSpec, target) -> Drafter | None:
    """target: a LoadedTarget. Returns None for plain decoding. A head kind named without a directory takes the
    target's shipped head when it is of that kind (``--drafter eagle3`` on the embedded default: its EAGLE-3 head
    alone, without the hybrid's lookup).
    """
    name = spec.name
    if name in (None, "none", "off"):
        return None
    if name == "default":
        name = default_drafter_name(target)
    p = Path(name).expanduser()
    if p.exists():
        return _from_path(p, spec, target)
    if "/" in name or name.startswith("."):
        raise DrafterLoadError(f"drafter path {name!r} does not exist")
    if name in HEAD_KINDS:  # `--drafter eagle3` on a target that ships an EAGLE-3 head: that head
        shipped = shipped_head(getattr(target, "name", ""))
        if shipped is not None and detect_kind(shipped) == name:
            return _from_path(shipped, spec, target)
    try:
        factory = get_drafter_factory(name)
    except KeyError as e:
        raise DrafterLoadError(str(e.args[0])) from None
    return factory(target=target, tree=spec.tree, **spec.options)


def _from_path(p: Path, spec: DrafterSpec, target) -> Drafter:
    if not p.is_dir() or not (p / "config.json").exists():
        raise DrafterLoadError(f"drafter path {p} must be a directory with config.json and weights")
    if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
        raise DrafterLoadError(f"drafter path {p} has no weights: expected model.safetensors or pytorch_model.bin")
    check_safetensors(p)
    kind = detect_kind(p)
    return get_drafter_factory(kind)(target=target, path=p, tree=spec.tree or recommended_tree(p), **spec.options)


def check_safetensors(p: Path) -> None:
    """Refuse a directory whose ``*.safetensors`` files are truncated or not safetensors at all.

    ``safe_open`` reads the header and checks that its tensors cover the file exactly, so a file cut
    short (an interrupted download) or random bytes fail here with a message instead of a
    ``SafetensorError`` traceback from deep inside a head loader.
    """
    from safetensors import SafetensorError, safe_open

    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as h:
                h.keys()
        except (SafetensorError, OSError) as e:
            raise DrafterLoadError(
                f"{f} is not a readable safetensors file ({e}); it may be truncated (an interrupted "
                "download or copy): fetch or export the head again"
            ) from None


def recommended_tree(p: Path) -> str | None:
    """The tree a head directory recommends (``eyas.json``: {"tree": ...}), used when --tree is not given."""
    f = p / "eyas.json"
    if not f.exists():
        return None
    import json

    return json.loads(f.read_text()).get("tree")


def detect_kind(p: Path) -> str:
    """'eagle3' (midlayer.* / d2t keys, checked first: a speculators-layout EAGLE-3 head also has
    fc.* + layers.0.*), 'eagle' (EAGLE-1: fc.* + layers.0.*), 'medusa' (vLLM or Medusa layout),
    'draft' for full causal LMs.
    """
    from eyas.formats.eagle3 import looks_like_eagle3_dir
    from eyas.formats.medusa import looks_like_medusa_dir

    if looks_like_eagle3_dir(p):
        return "eagle3"
    if eagle.looks_like_eagle_dir(p):
        return "eagle"
    if looks_like_medusa_dir(p):
        return "medusa"
    return "draft"


__all__ = ["DrafterSpec", "DrafterLoadError", "build_drafter", "drafter_names", "detect_kind"]
