"""Per-machine choices timed once and kept on disk (``$EYAS_CACHE/<kind>/<digest>.json``), keyed by what the timing
depends on: the CPU, its flags, torch's threads and version, and the compiled kernels' sources.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from eyas import kernels
from eyas.models.cpu import cpu_flags, cpu_name


def machine_key(**extra) -> dict:
    """The machine's part of a cache key, then ``extra`` (what else the measurement depends on), in that order."""
    return {"cpu": cpu_name(), "flags": sorted(cpu_flags()), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernels.sources_digest(), **extra}


def cached_json(kind: str, key: dict, measure: Callable[[], dict], cache_dir: Path | None = None) -> dict:
    """The record cached for ``key`` under ``cache_dir`` (default ``$EYAS_CACHE/<kind>``), else ``measure()``'s,
    written with the key beside it. Two processes measuring at once each write their own file, then one wins.
    """
    if cache_dir is None:
        from eyas.models.loading import cache_root  # (loading imports the modules that import this one)

        cache_dir = cache_root() / kind
    path = cache_dir / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    record = {"key": key, **measure()}
    write_atomic(path, json.dumps(record, indent=1))
    return record


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a file of this process's own beside it, then rename: a reader never sees a
    half-written file, and of two writers one wins whole.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def best_alternating(sides: dict[Hashable, Callable[[], None]], rounds: int, repeats: int) -> dict[Hashable, float]:
    """Seconds a call of each side takes: the best over ``rounds`` passes that alternate the sides (a slow spell of the
    machine touches all of them), each pass one warm call, then the mean of ``repeats`` timed calls.
    """
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(rounds):
        for name, run in sides.items():
            run()
            t = time.perf_counter()
            for _ in range(repeats):
                run()
            best[name] = min(best[name], (time.perf_counter() - t) / repeats)
    return best
