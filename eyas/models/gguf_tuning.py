"""The GGUF-block kernel's per-CPU choices, timed once per machine on the loaded target's own projections.

``eyas/kernels/gguf_bf16.cpp`` has two ways of running several rows that change no bit (every accumulator's
chain is the same either way) but whose speed depends on the CPU:

* ``prefetch``: with several rows, each block's dequantisation prefetches the same block of the weight group two
  ahead, so the weights stream in while the rows' products are computed;
* ``pair_as_triple``: run 2 rows as a 3-row register block (the third repeats the second into scratch).

Both were measured faster on the Zen 5 VM (full-width AVX-512; then ``prefetch`` fetched a whole group four ahead at
once). On a Zen 4 VM (AVX-512 on 256-bit halves) that whole-group prefetch and ``pair_as_triple`` were slower
(SmolLM2's 121 projections at 2 rows 9.44 ms with both against 7.02 ms with neither); the prefetch spread one a
block measured 0.99x the time without it at 2-3 rows and 0.94 / 0.93 / 0.90x at 4 / 6 / 8 (2026-11-28,
``scripts/kernel_ab.py --base HEAD --base-tuning 0,0 --tuning 1,0``). So the first load on a machine times the four
settings at 2, 3, 4 and 6 rows (the verify widths speculative steps use most, and a wider one where the prefetch
pays most), best of 5 rounds, about 5 s, and caches the fastest under ``$EYAS_CACHE/kernel_tuning/`` keyed by CPU,
threads and the kernels' sources. ``pair_as_triple`` is decided on the 2-row time alone (no other width of a verify
tree up to 9 nodes runs a 2-row block): summed over every width, the noise at the others outweighed it, and a Zen 4
VM kept 2 rows as a triple at 8.7 ms where a pair cost 8.3 (``scripts/projection_cost.py``).
``EYAS_GGUF_TUNING=PREFETCH,PAIR`` (e.g. ``0,0``) sets it by hand and skips the timing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.models.gguf_blocks import GGUFBlocks, block_kernel
from eyas.models.machine_cache import best_alternating, cached_json, machine_key
from eyas.notes import one_time_note

ROWS = (2, 3, 4, 6)  # rows timed: the verify widths adaptive trees use most, and a wider one
PICK_VERSION = 3  # in the cache key: choices made by an earlier rule (2: rows 2-4, 3 rounds) are timed again


@dataclass(frozen=True)
class KernelTuning:
    prefetch: bool = True
    pair_as_triple: bool = True

    @classmethod
    def parse(cls, text: str) -> KernelTuning:
        """``PREFETCH,PAIR`` as 0/1, e.g. ``0,0``."""
        parts = text.split(",")
        if len(parts) != 2 or any(p.strip() not in ("0", "1") for p in parts):
            raise ValueError(f"EYAS_GGUF_TUNING={text!r}: expected PREFETCH,PAIR_AS_TRIPLE as 0 or 1 each, e.g. 0,0")
        return cls(parts[0].strip() == "1", parts[1].strip() == "1")


SETTINGS = tuple(KernelTuning(p, t) for p in (True, False) for t in (True, False))


def pick(seconds: dict[KernelTuning, dict[int, float]]) -> KernelTuning:
    """The fastest setting from seconds by setting and rows. ``pair_as_triple`` only changes how a 2-row block
    runs, so it is judged on 2 rows alone: every other width counts at its best over the two pair settings (the
    same code, timed twice). A tie keeps the earlier setting in ``SETTINGS`` order (the Zen 5 defaults first).
    """
    def cost(s: KernelTuning) -> float:
        same_prefetch = [t for t in SETTINGS if t.prefetch == s.prefetch]
        return sum(seconds[s][r] if r == 2 else min(seconds[t][r] for t in same_prefetch) for r in seconds[s])

    return min(SETTINGS, key=lambda s: (cost(s), SETTINGS.index(s)))


def time_settings(kernel, blocks: list, rows=ROWS, rounds: int = 5,
                  repeats: int = 4) -> dict[KernelTuning, dict[int, float]]:
    """Seconds for every projection in ``blocks`` (GGUFBlocks) by setting and number of rows, best of ``rounds``
    passes that alternate through the settings (a slow spell of the machine touches all of them).
    """
    xs = {r: [torch.randn(r, b.k, generator=torch.Generator().manual_seed(r)).bfloat16() for b in blocks] for r in rows}
    empty = torch.empty(0)

    def side(s: KernelTuning, r: int):
        def run() -> None:  # every projection once at r rows under setting s
            kernel.set_tuning(s.prefetch, s.pair_as_triple)
            for b, x in zip(blocks, xs[r], strict=True):
                kernel.linear(x, b.data, b.qtype, empty)
        return run

    with torch.inference_mode():
        seconds = best_alternating({(s, r): side(s, r) for s in SETTINGS for r in rows}, rounds, repeats)
    return {s: {r: seconds[(s, r)] for r in rows} for s in SETTINGS}


def tune_block_kernel(model: nn.Module, cache_dir: Path | None = None, kernel=None) -> KernelTuning | None:
    """Set the kernel's tuning for this machine: ``EYAS_GGUF_TUNING``, else the cached choice, else timed on
    ``model``'s block projections and cached (default ``$EYAS_CACHE/kernel_tuning``). None where the model has no
    block projections.
    """
    kernel = kernel if kernel is not None else block_kernel()
    blocks = [b for m in model.modules() if isinstance(b := m.__dict__.get("_eyas_blocks"), GGUFBlocks)]
    if kernel is None or not blocks:
        return None
    if os.environ.get("EYAS_GGUF_TUNING"):
        return apply(kernel, KernelTuning.parse(os.environ["EYAS_GGUF_TUNING"]))
    shapes = sorted({(b.qtype, *b.data.shape) for b in blocks})

    def measure() -> dict:
        one_time_note("timing the bf16 block kernel's options on this CPU", "~5 s")
        seconds = time_settings(kernel, blocks)
        timed = [{**asdict(s), "ms_by_rows": {r: round(1e3 * v, 3) for r, v in by_rows.items()}}
                 for s, by_rows in seconds.items()]
        return {"choice": asdict(pick(seconds)), "timed_rows": list(ROWS), "timed": timed}

    record = cached_json("kernel_tuning", machine_key(shapes=shapes, pick=PICK_VERSION), measure, cache_dir)
    return apply(kernel, KernelTuning(**record["choice"]))


_active = KernelTuning()  # what the kernel runs with (its built-in defaults until apply)
_applied = False


def apply(kernel, tuning: KernelTuning) -> KernelTuning:
    global _active, _applied
    kernel.set_tuning(tuning.prefetch, tuning.pair_as_triple)
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

