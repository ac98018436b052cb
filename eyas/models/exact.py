"""Row invariance of the target's linear layers, probed at run time (exact mode).

Exact mode promises that a token's logits do not depend on how many tokens share its forward.
For the projections that holds when the GEMM gives each row the same bits whatever the number
of rows M. Whether it does depends on the library's kernel choice for (M, N, K), the dtype and
the thread count, so it is probed once per weight shape with random rows. Measured on the
AVX512-BF16 VM (bf16, oneDNN, 1 and 2 threads): every multi-row product gives a row the same bits
whatever M and the row's position, but the 1-row kernel (a GEMV) of SmolLM2's [576, 1536] down
projection rounds some rows differently. The probe answers with the smallest M from which every
row count up to ``MAX_ROWS`` agrees; the forward pads smaller inputs up to it (``linear``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models.cpu import cpu_flags, cpu_name
from eyas.models.gguf_blocks import F32_ROWS, attached_blocks
from eyas.models.gguf_blocks import f32_any_rows as _f32_any_rows
from eyas.models.gguf_tuning import prefill_on_blocks as _bf16_any_rows

# largest forward (tree nodes) exact mode checks; wider forwards are padded to it
MAX_ROWS = 64


def row_floor(mod: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Smallest m0 such that ``mod`` (a linear layer, [..., K] -> [..., N]) over any M in m0 .. max_rows rows gives
    every row the bits it gets in a ``max_rows``-row product.

    Differences are data-dependent (measured: the 1-row GEMV of a [576, 1536] bf16 weight rounds about one
    row in ten differently from the multi-row kernel), so each M is checked on ``max_rows`` random rows,
    split into consecutive chunks of M. Every M up to 16 is checked, then a sample of larger ones (kernels
    change at small M; the probe of a [49152, 576] weight takes ~1 s over all M, ~0.3 s this way).
    """
    g = torch.Generator().manual_seed(0)
    dtype = mod.scales.dtype if hasattr(mod, "scales") else mod.weight.dtype  # int8 layers: activation dtype
    x = torch.randn(max_rows, mod.in_features, generator=g).to(device=mod.weight.device, dtype=dtype)
    dense = getattr(mod, "dense", mod)  # the GEMM exact mode pads (GGUF blocks serve decoding, unpadded)
    ref = dense(x)
    floor = 1
    for m in sorted({*range(1, min(17, max_rows)), *range(20, max_rows, 4), max_rows - 1}):
        chunks = [dense(x[i : i + m]) for i in range(0, max_rows - m + 1, m)]
        if not torch.equal(torch.cat(chunks), ref[: len(chunks) * m]):
            floor = m + 1
    return floor


class RowFloor:
    """Probe results per (shape, dtype, device, threads): the row count each linear is padded to in exact mode.

    CPU results are also kept on disk (``$EYAS_CACHE/row_floors.json``, keyed by CPU model, torch
    version, threads, layer type, shape and dtype: what the kernel choice depends on), so a load
    after the first skips the probes (about a second for SmolLM2).
    """

    def __init__(self, store: Path | None = None) -> None:
        self._seen: dict[tuple, int] = {}
        self.store = store if store is not None else default_store()

    def __call__(self, mod: nn.Module) -> int:
        w = mod.weight
        kind = mod.gemm_kind() if hasattr(mod, "gemm_kind") else type(mod).__name__  # the GEMM the floor is of
        key = (tuple(w.shape), w.dtype, w.device, mod.bias is not None, torch.get_num_threads(), kind)
        if key not in self._seen:
            disk = _disk_key(key) if w.device.type == "cpu" else None
            known = self._load().get(disk) if disk else None
            self._seen[key] = known if isinstance(known, int) else row_floor(mod)
            if disk and known is None:
                self._save(disk, self._seen[key])
        return self._seen[key]

    def _load(self) -> dict:
        try:
            return json.loads(self.store.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, key: str, floor: int) -> None:
        try:
            data = {**self._load(), key: floor}
            self.store.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.store)
        except OSError:
            pass  # a read-only cache only costs the probe next time

    def table(self) -> dict[str, int]:
        """{"NxK dtype threads": floor} for reports."""
        return {f"{k[0][0]}x{k[0][1]} {str(k[1]).removeprefix('torch.')} t{k[4]}": v for k, v in self._seen.items()}


def default_store() -> Path:
    from eyas.models.loading import cache_root  # here, not at the top: loading imports native, which imports this

    return cache_root() / "row_floors.json"


def exact_by_default(model: nn.Module) -> bool:
    """Whether ``--exact`` is on when not given: always below fp32 (a token's logits otherwise depend on how many
    tokens share its forward); in float32 where exact mode is also the faster one: a CPU model whose projections
    read GGUF blocks (the row-invariant float32 block kernel) with the compiled tree attention and layer step.
    Measured on the Ice Lake VM (docs/benchmarks.md): plain decoding 1.15-1.24x, speculative 1.12-1.52x fast mode's.
    Elsewhere float32 exact mode pads its dense GEMMs and runs slower, so fast mode stays the default. The blocks
    are checked first: a dense model never builds the kernels just to be told no.
    """
    if model.dtype != torch.float32:
        return True
    if getattr(model, "device", torch.device("cpu")).type != "cpu":
        return False
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(attached_blocks(m) is not None for m in linears):
        return False
    from eyas import kernels

    return getattr(model, "path_kernel", lambda: None)() is not None and kernels.LAYER_OPS() is not None


def _cpu_model() -> str:
    flags = cpu_flags()
    return cpu_name() + "".join(f"+{f}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def _disk_key(key: tuple) -> str:
    shape, dtype, _, bias, threads, kind = key
    return f"{_cpu_model()}|torch {torch.__version__}|t{threads}|{kind}|{shape[0]}x{shape[1]}|{dtype}|bias={bias}"


class DecodeFloors:
    """Exact mode's decode and verification forwards: projections with GGUF blocks (eyas.models.gguf_blocks)
    run on the row-invariant block kernel at any row count, unpadded; the others pad to ``floors`` as in prefill.
    Prefill keeps the padded dense GEMM for every projection that writes its cache, so a prompt's cache does not
    depend on its chunking (unless the block kernel takes prefill too: ``linear``); its logit rows (the last
    token's, eyas.models.native) take these floors too.
    """

    def __init__(self, floors: RowFloor) -> None:
        self.floors = floors

    def __call__(self, mod: nn.Module) -> int:
        return self.floors(mod)


def linear(mod: nn.Module, x: torch.Tensor, floors: RowFloor | DecodeFloors | None) -> torch.Tensor:
    """x: [B, T, K] -> [B, T, N] through ``mod`` (nn.Linear or an int8 layer). With ``floors`` (exact mode),
    fewer rows than the probed floor are zero-padded so the GEMM runs the kernel every larger forward runs;
    with ``DecodeFloors``, a projection with GGUF blocks takes the row-invariant block kernel instead, and every exact
    forward does, prefill included, in float32 with the kernel's AVX-512 build (``f32_any_rows``) and in bf16 where
    the kernel runs several rows in FMAs (``eyas.models.gguf_tuning.prefill_on_blocks``).
    """
    if floors is not None:
        # exact forwards run under inference mode on the model's own dtype and device, so the blocks' presence
        # decides (blocks_of's checks cost ~1 us a call, 121 calls a token)
        blocks = attached_blocks(mod)
        if blocks is not None and not x.requires_grad and not x.is_cuda:
            if (x.dtype == torch.float32 and _f32_any_rows()) or (x.dtype == torch.bfloat16 and _bf16_any_rows()):
                return blocks.linear(x, mod.bias)  # row-invariant at any count: prefill too, unpadded
            if type(floors) is DecodeFloors and (
                    x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.numel() <= F32_ROWS * x.shape[-1])):
                return blocks.linear(x, mod.bias)  # decode / verify: both kernels are row-invariant, no padding
        b, t, k = x.shape
        need = floors(mod)
        dense = getattr(mod, "dense", mod)
        if b * t < need:
            padded = torch.cat([x.reshape(b * t, k), x.new_zeros(need - b * t, k)])
            return dense(padded)[: b * t].view(b, t, -1)
        return dense(x)
    if type(mod) is nn.Linear:
        return F.linear(x, mod.weight, mod.bias)
    return mod(x)
