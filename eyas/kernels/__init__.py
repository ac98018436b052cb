"""Native CPU kernels, compiled on first use for this machine (``torch.utils.cpp_extension``).

One getter per source, each returning the module or None where it cannot be built (no C++ compiler or ninja,
an unsupported platform) or its switch turns it off; callers then keep the pure-PyTorch path:

- ``path_attention()`` (``path_attn.cpp``, ``EYAS_PATH_KERNEL``): exact mode's tree attention and batched decode;
- ``skinny_gemm()`` (``skinny_gemm.cpp``, ``EYAS_SKINNY_GEMM``): few-row float32 projections;
- ``rms_norm()`` (``rms_norm.cpp``, ``EYAS_NORM_KERNEL``): one-pass RMSNorm;
- ``gguf_bf16()`` (``gguf_bf16.cpp``, ``EYAS_GGUF_BLOCKS``): bf16 projections over GGUF blocks;
- ``gguf_f32()`` (``gguf_f32.cpp``, ``EYAS_GGUF_BLOCKS``): float32 projections over GGUF blocks, a few rows;
- ``head_i8()`` (``head_i8.cpp``, ``EYAS_HEAD_INT8``): a draft head's few-row projections in int8 (AVX512-VNNI or
  AVX2);
- ``lm_screen()`` (``lm_screen.cpp``, ``EYAS_LM_SCREEN``): greedy decoding's output projection, screened in int8
  (AVX512-VNNI) so that only the few logits that can be the argmax are computed exactly;
- ``layer_ops()`` (``layer_ops.cpp``, ``EYAS_LAYER_OPS``): RoPE + KV-cache write of exact decode forwards, and
  the row argmax greedy verification reads (``argmax``);
- ``head_step()`` (``head_step.cpp``, ``EYAS_HEAD_STEP``): an EAGLE-3 head's whole call (the fused taps'
  projection, embedding, every decoder layer, vocabulary head, log-softmax, top-k) as one native call over the
  kernels above (their bodies are the ``.h`` files the modules bind);
- ``decode_step()`` (``decode_step.cpp``, ``EYAS_DECODE_STEP``): a bf16 target's exact decode / verify forward through
  every decoder layer as one native call over the same kernels (eyas.models.decode_plan).

Hot paths hold a ``Lazy`` of their getter (resolved once per process). The build (10-15 s a kernel on 2 cores; the
sources include ``torch_ext.h``, not ``torch/extension.h``, which made it ~25 s)
happens once per CPU kind and torch version: its output lives under ``$EYAS_CACHE/kernels/<key>/`` and later
loads take milliseconds. ``-march=native`` is part of the key, so a cache copied to another CPU is not reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eyas.notes import one_time_note

_HERE = Path(__file__).parent
# -fopenmp: at::parallel_for is a header template, compiled into this module; without OpenMP its tasks run on
# one thread
_FLAGS = ["-O3", "-march=native", "-fopenmp"] if sys.platform.startswith("linux") else ["-O3"]
_LDFLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
# a kernel's flags beyond _FLAGS: -ffp-contract=off where its results must round like their torch or numpy reference
# (multiply, then add)
_OWN_FLAGS = {name: ["-ffp-contract=off"] for name in ("gguf_bf16", "gguf_f32", "head_i8", "layer_ops", "head_step",
                                                         "decode_step")}
_lock = threading.Lock()
_loaded: dict[str, object] = {}
# name (eyas/kernels/<name>.cpp) -> (what the one-time note calls it, the environment switch that turns it off)
_KERNELS = {
    "path_attn": ("the exact-mode tree attention kernel", "EYAS_PATH_KERNEL"),
    "skinny_gemm": ("the few-row float32 projection kernel", "EYAS_SKINNY_GEMM"),
    "rms_norm": ("the RMSNorm kernel", "EYAS_NORM_KERNEL"),
    "gguf_bf16": ("the bf16 GGUF-block projection kernel", "EYAS_GGUF_BLOCKS"),
    "gguf_f32": ("the float32 GGUF-block projection kernel", "EYAS_GGUF_BLOCKS"),
    "head_i8": ("the draft head's int8 projection kernel", "EYAS_HEAD_INT8"),
    "lm_screen": ("the greedy output-projection screen", "EYAS_LM_SCREEN"),
    "layer_ops": ("the decode-layer kernel", "EYAS_LAYER_OPS"),
    "head_step": ("the draft head's one-call step", "EYAS_HEAD_STEP"),
    "decode_step": ("the target's one-call decode forward", "EYAS_DECODE_STEP"),
}
# the CPU flag a kernel needs (not built where it could not serve): the screen AVX512-VNNI, the head's int8 AVX2
_NEEDS = {"head_i8": "avx2", "lm_screen": "avx512_vnni", "head_step": "avx2"}
# what a CPU target of each dtype uses (prebuild's default); anything else builds on first use
USED_BY = {torch.bfloat16: ("gguf_bf16", "path_attn", "lm_screen", "head_i8", "rms_norm", "layer_ops", "head_step",
                           "decode_step"),
           torch.float32: ("gguf_f32", "skinny_gemm", "path_attn", "head_i8", "rms_norm", "layer_ops", "head_step")}


def _headers() -> list[Path]:
    """The headers the sources include (by name, from beside them)."""
    return sorted(_HERE.glob("*.h"))


def _build_dir(source: Path, flags: list[str] = ()) -> Path:
    from eyas.models.cpu import cpu_flags, cpu_name
    from eyas.models.loading import cache_root

    headers = b"".join(h.read_bytes() for h in _headers())
    # the torch install too: a build names its headers' paths, so another environment's build would be rebuilt
    key = (f"{cpu_name()}|{sorted(cpu_flags())}|{torch.__version__}|{Path(torch.__file__).parent}|"
           f"{sys.version_info[:2]}|{_FLAGS + list(flags)}|{source.read_bytes()!r}|{headers!r}")
    return cache_root() / "kernels" / hashlib.sha256(key.encode()).hexdigest()[:16]


class Lazy:
    """A kernel getter resolved once per process, then a plain read: hot paths ask for their kernel on every call
    (121 projections a token), cheaper than the getters' environment and lock checks.

        _kernel = Lazy(gguf_bf16, usable=lambda k: k.available())
        k = _kernel()  # the module, or None where it is off, unavailable or cannot be built
    """

    def __init__(self, getter, usable=None) -> None:
        self.getter, self.usable = getter, usable
        self.value = None  # the module, False where there is none, None before the first look

    def __call__(self):
        if self.value is None:
            mod = self.getter()
            self.value = mod if mod is not None and (self.usable is None or self.usable(mod)) else False
        return self.value or None


def sources_digest() -> str:
    """sha256 (16 hex digits) of every kernel source: a cost table measured on other kernels is stale."""
    h = hashlib.sha256()
    for f in sorted([*_HERE.glob("*.cpp"), *_HERE.glob("*.h")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def path_attention():
    """The compiled module (``path_attention(q, k, v, start, path, lengths, scale)``, ``supports(group, head_dim)``),
    or None where it is off or cannot be built (a one-line warning says why, once).
    """
    return _get("path_attn") if _wanted("path_attn") else None


def skinny_gemm():
    """The compiled few-row float32 projection (``linear(x, w, bias)`` for x [M <= max_rows(), K], w [N, K]),
    or None where it is off (``EYAS_SKINNY_GEMM=0``) or cannot be built.
    """
    return _get("skinny_gemm") if _wanted("skinny_gemm") else None


def rms_norm():
    """The compiled one-pass RMSNorm (``rms_norm(x, w, eps)``, bf16 or float32 CPU tensors), or None where it is off
    (``EYAS_NORM_KERNEL=0``) or cannot be built.
    """
    return _get("rms_norm") if _wanted("rms_norm") else None


def gguf_bf16():
    """The compiled bf16 projection over GGUF blocks (``linear(x, blocks, qtype, bias)``, ``dequantize(blocks,
    qtype, k)``, ``available()``: False where the CPU lacks AVX512-BF16), or None where it is off
    (``EYAS_GGUF_BLOCKS=0``) or cannot be built. Built with ``-ffp-contract=off``: the dequantisation must
    round like gguf-py's numpy (multiply, then add).
    """
    return _get("gguf_bf16") if _wanted("gguf_bf16") else None


def gguf_f32():
    """The compiled float32 projection over GGUF blocks for a few rows (``linear(x, blocks, qtype, bias)``,
    ``dequantize(blocks, qtype, k)``, ``available()``: False where the CPU lacks AVX2/FMA/F16C), or None where it
    is off (``EYAS_GGUF_BLOCKS=0``) or cannot be built. Its sums are ``skinny_gemm()``'s, bit for bit.
    """
    return _get("gguf_f32") if _wanted("gguf_f32") else None


def head_i8():
    """The compiled int8 projection for a draft head's few rows (``linear(x, w, sw, sums, bias)``, ``available()``:
    False where the build has neither AVX512-VNNI nor AVX2), or None where it is off (``EYAS_HEAD_INT8=0``), the CPU
    has no AVX2 (then it is not built) or it cannot be built. Built with ``-ffp-contract=off``: its float epilogue
    must round as the torch reference does (multiply, then add).
    """
    return _get("head_i8") if _wanted("head_i8") else None


def lm_screen():
    """The compiled argmax screen for a bf16 Q8_0 output projection (``pack(blocks, k)``, then ``candidates(x, packed,
    vocab)`` and ``approx(x, packed, vocab)``; ``available()``: False where the build lacks AVX512-VNNI), or None where
    it is off (``EYAS_LM_SCREEN=0``), the CPU has no AVX512-VNNI (then it is not built) or it cannot be built.
    """
    return _get("lm_screen") if _wanted("lm_screen") else None


def layer_ops():
    """The compiled decode-layer steps (``rope_cache``: RoPE on q and k, k and v into the float32 cache, q as
    float32, torch's bf16 numerics bit for bit), or None where it is off (``EYAS_LAYER_OPS=0``) or cannot be built.
    """
    return _get("layer_ops") if _wanted("layer_ops") else None


def head_step():
    """The compiled head call (``HeadStep(...)``, then ``.run(...)``: eyas.drafters.head_step; ``available()``: False
    where the build has neither AVX512-VNNI nor AVX2), or None where it is off (``EYAS_HEAD_STEP=0``), the CPU has no
    AVX2 (then it is not built) or it cannot be built. Built with ``-ffp-contract=off``, as the kernels it calls.
    """
    return _get("head_step") if _wanted("head_step") else None


def decode_step():
    """The compiled decode forward (``DecodeStep(layers, eps, heads, kv_heads, head_dim)``, then ``.run(...)``:
    eyas.models.decode_plan; ``available()``: False where the build lacks AVX512-BF16; ``set_tuning`` as
    ``gguf_bf16``'s, for this module's own copy of the block kernel), or None where it is off (``EYAS_DECODE_STEP=0``)
    or cannot be built. Built with ``-ffp-contract=off``, as the kernels it calls.
    """
    return _get("decode_step") if _wanted("decode_step") else None


# the one process-wide handle on layer_ops (exact decode forwards, the draft head's layer, the greedy argmax)
LAYER_OPS = Lazy(layer_ops)


def build_flags(name: str) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) eyas builds ``eyas/kernels/<name>.cpp`` with; scripts that build an earlier
    revision's source to compare against use them too (scripts/kernel_ab.py).
    """
    return [*_FLAGS, *_OWN_FLAGS.get(name, [])], list(_LDFLAGS)


def prefetch_env(name: str, default: int, what: str) -> int:
    """A kernel's software-prefetch distance from the environment variable ``name`` (``default`` where unset): weight
    groups ahead, 0 (off) to 64; anything else is refused, saying ``what`` it sets.
    """
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) > 64:
        raise ValueError(f"{name}={raw!r}: {what}, 0 (off) to 64")
    return int(raw)


def loaded(name: str):
    """``name``'s module where this process has already loaded it, else None (builds nothing)."""
    return _loaded.get(name) or None


def _wanted(name: str) -> bool:
    """Whether this machine builds ``name``: its switch is not 0 and the CPU can run it."""
    if os.environ.get(_KERNELS[name][1], "1") == "0":
        return False
    if name in _NEEDS:
        from eyas.models.cpu import cpu_flags

        return _NEEDS[name] in cpu_flags()
    return True


def _out_dir(name: str) -> Path:
    """Where ``name``'s build lives (``_build_dir`` of its source and own flags)."""
    return _build_dir(_HERE / f"{name}.cpp", _OWN_FLAGS.get(name, []))


def _is_built(name: str, out: Path) -> bool:
    """Whether ``out`` (``_out_dir(name)``) holds a finished build of its own copy of the source."""
    ninja = out / "build.ninja"
    return any(out.glob("*.so")) and ninja.exists() and str(out / "src" / f"{name}.cpp") in ninja.read_text()


def prebuild(names: tuple[str, ...] | None = None) -> None:
    """Compile the kernels among ``names`` (default: all) that this machine uses and has not built yet, several at
    once: each build is one single-threaded compiler (10-15 s), so on first use a process would otherwise wait for
    them one after another (all 8 on 2 cores: 63 s this way; ~216 s one by one before torch_ext.h). The
    builds run in child processes, as many at a time as there are cores; what a child fails to build is built (or
    reported) here on first use as before.
    """
    todo = [n for n in (names or tuple(_KERNELS)) if n not in _loaded and _wanted(n) and not _is_built(n, _out_dir(n))]
    jobs = min(len(todo), os.cpu_count() or 1)
    _ninja_on_path()
    if jobs < 2 or not _can_compile():
        return  # nothing to run side by side; or no toolchain: each first use warns, once, as before
    one_time_note(f"compiling {len(todo)} CPU kernels for this CPU, {jobs} at a time",
                  f"~{-(-len(todo) // jobs) * 20} s")

    def build(name: str) -> None:
        code = f"from eyas import kernels; kernels._get({name!r})"
        subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(build, todo))


def _can_compile() -> bool:
    """Whether torch's extension builder finds its tools: ninja and the C++ compiler (``$CXX``, else ``c++``)."""
    return shutil.which("ninja") is not None and shutil.which(os.environ.get("CXX", "c++")) is not None


def _get(name: str):
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def _build(name: str):
    from torch.utils.cpp_extension import load

    what, env = _KERNELS[name]
    out = _out_dir(name)
    cflags, ldflags = build_flags(name)
    _ninja_on_path()
    try:
        out.mkdir(parents=True, exist_ok=True)
        copy = _stable_copy(_HERE / f"{name}.cpp", out)
        if not _is_built(name, out):
            one_time_note(f"compiling {what} for this CPU", "~15 s")
        mod = load(f"eyas_{name}", [str(copy)], extra_cflags=cflags, extra_ldflags=ldflags,
                   build_directory=str(out), verbose=False)
        _stamp(out / "last_used")
        return mod
    except Exception as e:  # no compiler, no ninja, a failed build: callers keep their PyTorch path
        warnings.warn(f"eyas: {what} unavailable ({type(e).__name__}: {str(e)[:200]}); using the slower PyTorch "
                      f"path (set {env}=0 to skip the build)", stacklevel=3)
        return None


def _stamp(path: Path) -> None:
    """Mark a build as loaded now (`eyas cache purge --stale` removes builds not loaded for a while); a read-only
    cache keeps its builds without the mark.
    """
    try:
        path.touch()
    except OSError:
        pass


def _stable_copy(source: Path, out: Path) -> Path:
    """The source and the headers it includes, copied once into its build directory (keyed by their content and the
    torch install): the build always names the same path, so another checkout or the installed copy of the same
    sources reuses the compiled module instead of rebuilding it (ninja rebuilds, silently, when a source's path or
    time changes).
    """
    src = out / "src"
    src.mkdir(exist_ok=True)
    for f in [source, *_headers()]:
        dst = src / f.name
        if not dst.exists():  # the content is the directory's key: an existing copy is this one
            tmp = src / f"{f.name}.{os.getpid()}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, dst)
    return src / source.name


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the PyPI wheel's copy sits beside this interpreter,
    which is not on PATH when eyas runs as ``.venv/bin/eyas`` without an activated venv.
    """
    if shutil.which("ninja") is None:
        bindir = Path(sys.executable).parent
        if (bindir / "ninja").exists():
            os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] long, ``logits.argmax(-1)``: on a CPU through ``layer_ops.argmax_rows`` (one AVX-512 pass, the
    same indices: first maximum, NaN first; ~4x torch's for [4, 49152] on the Zen 5 VM), elsewhere torch's.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.ndim == 2 and logits.stride(-1) == 1:
        ops = LAYER_OPS()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)
