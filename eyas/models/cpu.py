"""What this CPU is: its model name and instruction-set flags (from /proc/cpuinfo), read once.

Kernel choice depends on both, so exact mode's row-floor store, the tree-sizing cost cache and the
benchmarks' settings key or label their results by them, and ``--dtype auto`` reads the bf16 flags.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU's model name, e.g. 'AMD EPYC' ('unknown' where /proc/cpuinfo says nothing)."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")


def cpu_flags() -> frozenset[str]:
    """The CPU's flags (avx2, avx512_bf16, amx_bf16, ...); empty where unknown."""
    info = _cpuinfo()
    return frozenset(info.split()) if info is not None else frozenset()
