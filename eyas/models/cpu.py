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
    """The CPU's model name with its family and model numbers, e.g. 'AMD EPYC (family 26, model 2)': cloud VMs
    often say only 'AMD EPYC', and Zen 4 (family 25) and Zen 5 (family 26) run the same bf16 kernels at
    very different speeds ('unknown' where /proc/cpuinfo says nothing).
    """
    info = _cpuinfo()
    if info is None:
        return platform.processor() or "unknown"
    fields = {}
    for ln in info.splitlines():
        if not ln.strip():
            break  # the first processor's block
        key, _, value = ln.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def cpu_flags() -> frozenset[str]:
    """The CPU's flags (avx2, avx512_bf16, amx_bf16, ...): the first processor's ``flags`` line, so that caches
    keyed by them do not change with the clock ('cpu MHz', 'bogomips'); empty where unknown.
    """
    info = _cpuinfo()
    if info is None:
        return frozenset()
    return parse_flags(info)


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The words of the first ``flags`` (x86) or ``Features`` (Arm) line of a /proc/cpuinfo text."""
    for ln in cpuinfo.splitlines():
        key, sep, value = ln.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# the flags of native bf16 matmuls on a CPU (without them oneDNN and torch emulate bf16 in float32)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); False where its flags are unknown."""
    return bool(cpu_flags() & BF16_FLAGS)
