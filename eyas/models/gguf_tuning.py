"""The GGUF-block kernel's per-CPU choices, timed once per machine on the loaded target's own projections.

``eyas/kernels/gguf_bf16.cpp`` has five ways of running rows that change no bit (every accumulator's chain is the
same either way) but whose speed depends on the CPU:

* ``prefetch``: with several rows, each block's dequantisation prefetches the same block of the weight group two
  ahead, so the weights stream in while the rows' products are computed;
* ``pair_as_triple``: run 2 rows as a 3-row register block (the third repeats the second into scratch);
* ``fma_rows``: several rows multiply in float32 FMAs, two per VDPBF16PS, with the instruction's bits (offered only
  where the kernel's ``fma_rows_exact()`` self-test finds this CPU's VDPBF16PS to be the two FMAs of Intel's
  definition; the kernel falls back per call on inputs where a denormal could make them differ). On an Intel Xeon
  6/207, whose VDPBF16PS runs at half the FMA rate, SmolLM2's 121 projections at 2 / 3 / 4 / 6 / 8 rows took 11.0 /
  12.0 / 13.1 / 16.1 / 18.8 ms against 11.7 / 13.1 / 15.0 / 18.7 / 22.6 (1 row, which never uses it: 11.1);
* ``prefetch_one``: one row (plain decoding) prefetches as several rows do. Measured no better on the Zen 5 VM; on
  the Intel Xeon 6/207 the 121 projections at one row took 8.9 ms with it against 10.7-11.3 without;
* ``fused_rows``: up to 4 rows of packed Q4 blocks multiply each block in registers as it is dequantised, not through
  the L1 buffer (faster on the Intel Xeon 6/207; never measured on AMD, where a similar fusion once measured slower).

``prefetch`` and ``pair_as_triple`` were both measured faster on the Zen 5 VM (full-width AVX-512; then ``prefetch``
fetched a whole group four ahead at once). On a Zen 4 VM (AVX-512 on 256-bit halves) that whole-group prefetch and
``pair_as_triple`` were slower (SmolLM2's 121 projections at 2 rows 9.44 ms with both against 7.02 ms with neither);
the prefetch spread one a block measured 0.99x the time without it at 2-3 rows and 0.94 / 0.93 / 0.90x at 4 / 6 / 8
(2026-11-28, ``scripts/kernel_ab.py --base HEAD --base-tuning 0,0 --tuning 1,0``). So the first load on a machine
times the four settings (six where ``fma_rows`` may run) at 2, 3, 4 and 6 rows (the verify widths speculative steps
use most, and a wider one where the prefetch pays most), best of 5 rounds, then ``prefetch_one`` on and off at one row
under the chosen setting (a separate decision: one row runs none of the other options), then ``fused_rows`` on and off
at 1-4 rows, about 8-11 s in all, and caches the fastest under ``$EYAS_CACHE/kernel_tuning/`` keyed by CPU, threads
and the kernels' sources. ``pair_as_triple`` is decided on the 2-row time alone (no other width of a verify tree up to
9 nodes runs a 2-row block): summed over every width, the noise at the others outweighed it, and a Zen 4 VM kept 2
rows as a triple at 8.7 ms where a pair cost 8.3 (``scripts/projection_cost.py``).
``fma_rows`` is judged on every width, against the better pair setting of the same prefetch.
The prefetch is turned off only where that is ``PREFETCH_MARGIN`` (5 %) faster summed over the widths: on the Zen 4 VM
13 of 14 timings (2026-12-01/02, one per kernel build) put the prefetch at 0.76-0.92x the time without it and the 14th,
on a slow spell, at 1.037x, so it went off; decoding steps then cost 1.05-1.27x at 2-6 verify nodes (one process, the
two settings alternating: 8.18 / 9.31 / 12.15 / 14.46 ms at 2 / 3 / 4 / 6 nodes against 7.77 / 8.80 / 9.56 / 13.31), the
tree was sized on those costs and the README's command fell to 0.93-1.00x, for as long as the cached choice stood. No
timing on these CPUs has put the prefetch more than 4 % behind (that spell's); its absence cost up to a quarter.
``EYAS_GGUF_TUNING=PREFETCH,PAIR[,FMA[,PREFETCH_ONE[,FUSED]]]`` (e.g. ``0,0`` or ``1,0,1,1,1``) sets it by hand and
skips the timing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from eyas import kernels
from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks, block_kernel
from eyas.models.machine_cache import best_alternating, cached_json, machine_key
from eyas.notes import one_time_note

ROWS = (2, 3, 4, 6)  # rows timed: the verify widths adaptive trees use most, and a wider one
PICK_VERSION = 7  # in the cache key: choices made by an earlier rule (6: no prefetch margin) are timed again
PREFETCH_MARGIN = 0.05  # how much faster (summed) a setting without the prefetch must be to be chosen
FUSED_TIMED = (1, 2, 3, 4)  # rows fused_rows serves
_SET_TUNING_DEFAULTS = (False, False, True)  # gguf_bf16.set_tuning's fma_rows, prefetch_one, fused_rows


@dataclass(frozen=True)
class KernelTuning:
    prefetch: bool = True
    pair_as_triple: bool = True  # unused under fma_rows (its several-row blocks are FMA blocks)
    fma_rows: bool = False
    prefetch_one: bool = False  # one row prefetches too (prefetch is for several)
    fused_rows: bool = True  # 1-4 rows of packed Q4 blocks in registers, not through the buffer

    @classmethod
    def parse(cls, text: str) -> KernelTuning:
        """``PREFETCH,PAIR[,FMA[,PREFETCH_ONE[,FUSED]]]`` as 0/1, e.g. ``0,0``, ``1,0,1`` or ``1,0,1,1,1``."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (2, 3, 4, 5) or any(p not in ("0", "1") for p in parts):
            raise ValueError(f"EYAS_GGUF_TUNING={text!r}: expected PREFETCH,PAIR_AS_TRIPLE[,FMA_ROWS[,PREFETCH_ONE"
                             "[,FUSED_ROWS]]] as 0 or 1 each, e.g. 0,0 or 1,0,1,1,1")
        return cls(*(p == "1" for p in parts))


SETTINGS = tuple(KernelTuning(p, t) for p in (True, False) for t in (True, False))
FMA_SETTINGS = tuple(KernelTuning(p, False, True) for p in (True, False))


def fma_exact(kernel) -> bool:
    """Whether ``kernel`` can run several rows in FMAs with VDPBF16PS's bits on this CPU (its own self-test)."""
    exact = getattr(kernel, "fma_rows_exact", None)
    return exact is not None and bool(exact())


def settings_for(kernel) -> tuple[KernelTuning, ...]:
    """What may be timed on ``kernel``: the FMA settings only where they keep every bit."""
    return SETTINGS + FMA_SETTINGS if fma_exact(kernel) else SETTINGS


def pick(seconds: dict[KernelTuning, dict[int, float]]) -> KernelTuning:
    """The fastest setting from seconds by setting and rows. ``pair_as_triple`` only changes how a 2-row block
    runs, so it is judged on 2 rows alone: every other width counts at its best over the two pair settings of the
    same code (the same prefetch and ``fma_rows``, timed twice). A tie keeps the earlier setting in ``seconds``'
    order (``settings_for``: the Zen 5 defaults first). A setting without the prefetch must beat the best with it by
    ``PREFETCH_MARGIN``: one slow spell over the timing must not turn off what saves most where memory is contended.
    """
    order = list(seconds)

    def cost(s: KernelTuning) -> float:
        same = [t for t in order if (t.prefetch, t.fma_rows) == (s.prefetch, s.fma_rows)]
        return sum(seconds[s][r] if r == 2 else min(seconds[t][r] for t in same) for r in seconds[s])

    def best(settings: list[KernelTuning]) -> KernelTuning:
        return min(settings, key=lambda s: (cost(s), order.index(s)))

    fastest, fetching = best(order), [s for s in order if s.prefetch]
    if fastest.prefetch or not fetching:
        return fastest
    kept = best(fetching)
    return fastest if cost(fastest) < (1 - PREFETCH_MARGIN) * cost(kept) else kept


def pick_one_row(seconds: dict[KernelTuning, dict[int, float]]) -> KernelTuning:
    """The faster of the settings in ``seconds`` (the chosen one with ``prefetch_one`` off and on) at one row; a tie
    keeps the prefetch off.
    """
    return min(seconds, key=lambda s: (seconds[s][1], s.prefetch_one))


def pick_fused(seconds: dict[KernelTuning, dict[int, float]]) -> KernelTuning:
    """The faster of the settings in ``seconds`` (the chosen one with ``fused_rows`` on and off) over the rows it
    serves, summed; a tie keeps it on.
    """
    return min(seconds, key=lambda s: (sum(seconds[s].values()), not s.fused_rows))


def time_settings(kernel, blocks: list, rows=ROWS, rounds: int = 5, repeats: int = 4,
                  settings: tuple[KernelTuning, ...] = SETTINGS) -> dict[KernelTuning, dict[int, float]]:
    """Seconds for every projection in ``blocks`` (GGUFBlocks) by setting and number of rows, best of ``rounds``
    passes that alternate through the settings (a slow spell of the machine touches all of them).
    """
    xs = {r: [torch.randn(r, b.k, generator=torch.Generator().manual_seed(r)).bfloat16() for b in blocks] for r in rows}
    empty = torch.empty(0)
    operands = [b.operands(torch.bfloat16) for b in blocks]  # what the model's calls read

    def side(s: KernelTuning, r: int):
        def run() -> None:  # every projection once at r rows under setting s
            set_on(kernel, s)
            for (data, code), x in zip(operands, xs[r], strict=True):
                kernel.linear(x, data, code, empty)
        return run

    with torch.inference_mode():
        seconds = best_alternating({(s, r): side(s, r) for s in settings for r in rows}, rounds, repeats)
    return {s: {r: seconds[(s, r)] for r in rows} for s in settings}


def set_on(kernel, s: KernelTuning) -> None:
    """Set ``s`` on ``kernel`` (no bookkeeping: ``apply`` records what the process runs with). Trailing options at
    ``set_tuning``'s defaults are left out, so a kernel built before them (scripts/kernel_ab.py's base) takes ``s``
    wherever it asks nothing that kernel lacks.
    """
    args = [s.prefetch, s.pair_as_triple, s.fma_rows, s.prefetch_one, s.fused_rows]
    while len(args) > 2 and args[-1] == _SET_TUNING_DEFAULTS[len(args) - 3]:
        args.pop()
    kernel.set_tuning(*args)


def tune_block_kernel(model: nn.Module, cache_dir: Path | None = None, kernel=None) -> KernelTuning | None:
    """Set the kernel's tuning for this machine: ``EYAS_GGUF_TUNING``, else the cached choice, else timed on
    ``model``'s block projections and cached (default ``$EYAS_CACHE/kernel_tuning``). None where the model has no
    block projections.
    """
    kernel = kernel if kernel is not None else block_kernel()
    blocks = _blocks(model)
    if kernel is None or not blocks:
        return None
    if os.environ.get("EYAS_GGUF_TUNING"):
        return apply(kernel, KernelTuning.parse(os.environ["EYAS_GGUF_TUNING"]))
    shapes = sorted({(b.qtype, *b.data.shape) for b in blocks})

    def measure() -> dict:
        one_time_note("timing the bf16 block kernel's options on this CPU", "~8-11 s")
        seconds = time_settings(kernel, blocks, settings=settings_for(kernel))
        several = pick(seconds)
        one = time_settings(kernel, blocks, rows=(1,), settings=(several, replace(several, prefetch_one=True)))
        chosen = pick_one_row(one)
        fused = time_settings(kernel, blocks, rows=FUSED_TIMED, settings=(chosen, replace(chosen, fused_rows=False)))
        timed = [{**asdict(s), "ms_by_rows": {r: round(1e3 * v, 3) for r, v in by_rows.items()}}
                 for s, by_rows in (*seconds.items(), *one.items(), *fused.items())]
        return {"choice": asdict(pick_fused(fused)), "timed_rows": [1, *ROWS], "timed": timed}

    record = cached_json("kernel_tuning", machine_key(shapes=shapes, pick=PICK_VERSION), measure, cache_dir)
    return apply(kernel, KernelTuning(**record["choice"]))


_active = KernelTuning()  # what the kernel runs with (its built-in defaults until apply)
_applied = False


def apply(kernel, tuning: KernelTuning) -> KernelTuning:
    global _active, _applied
    if tuning.fma_rows and not fma_exact(kernel):
        raise ValueError("fma_rows: this CPU's VDPBF16PS does not give the bits of two float32 FMAs (the kernel's "
                         "fma_rows_exact() self-test), so several rows cannot run in FMAs here; set EYAS_GGUF_TUNING's "
                         "third value to 0 or leave it out")
    set_on(kernel, tuning)
    native = kernels.loaded("decode_step")  # the target's one-call forward holds its own copy of the block kernel
    if native is not None and kernel is block_kernel():
        set_on(native, tuning)
    _active, _applied = tuning, True
    return tuning


def tune_once(model: nn.Module) -> KernelTuning | None:
    """``tune_block_kernel`` unless this process has already set the tuning (a draft head's blocks: the target's,
    where it has any, were timed first and stand).
    """
    return _active if _applied else tune_block_kernel(model)


def active() -> KernelTuning:
    """The setting the kernel runs with in this process (costs measured under another are stale)."""
    return _active


def in_use(model: nn.Module) -> KernelTuning | None:
    """``active()`` where ``model``'s projections run on the bf16 block kernel (what a benchmark records beside its
    figures: a choice cached from a noisy first load shows there), else None.
    """
    return _active if _blocks(model) and getattr(model, "dtype", None) == torch.bfloat16 and block_kernel() else None


def _blocks(model: nn.Module) -> list[GGUFBlocks]:
    """The GGUF blocks attached to ``model``'s projections (eyas.models.gguf_blocks), in module order."""
    return [b for m in model.modules() if isinstance(b := attached_blocks(m), GGUFBlocks)]


def prefill_on_blocks() -> bool:
    """Whether bf16 exact mode's prefill reads the GGUF blocks too (eyas.models.exact.linear) instead of oneDNN's
    GEMM padded to its row floors: where the kernel runs several rows in FMAs (``fma_rows``). On the Intel Xeon 6/207
    the layers' 120 projections then took 15.8 / 44.3 / 77.5 / 167.6 ms at 8 / 32 / 64 / 128 rows against oneDNN's
    22.2 / 51.9 / 92.5 / 173.3 (``scripts/prefill_ab.py --rows 8,32,64,128 --dtype bfloat16``; under VDPBF16PS the
    blocks were 1.06-1.17x slower past 32 rows). The block kernel is row-invariant, so a prompt's cache is the same
    in any chunking, and the same bits a decoding step leaves for the same tokens (``scripts/decode_kv_check.py``).
    A choice that changes bits (both sides' alike: lossless either way), decided by the cached tuning, so it is the
    same in every process on a machine.
    """
    return _active.fma_rows

