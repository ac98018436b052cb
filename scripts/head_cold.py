"""Time a draft head's int8 projections the way a decoding step meets them: weights cold (a verify forward has just
streamed the target's weights through the caches) and hot (the next tree level), by the kernel's software prefetch
distance (``eyas/kernels/head_i8.cpp``: weight groups ahead, 0 off).

Each pass flushes the caches by writing a 160 MB buffer, then runs the head's projections (fused q|k|v, o, fused
gate|up, down, lm_head) once at ``--rows`` rows (the cold call), then once more (the hot call); distances alternate
pass by pass, medians over ``--passes``. Needs a head on the int8 kernel (a float32 head on a CPU with AVX2, or
``--dtype bfloat16`` where a bf16 head takes int8 projections).
``--against-q8``: instead, the int8 projections (prefetch 2) against the same weights as Q8_0 blocks on the float32
block kernel (what the head ran on an AVX2-only CPU before the int8 kernel's AVX2 body), alternating pass by pass.
``--layouts``: instead, the same int8 weights as plain rows (prefetch 2, before 2026-12-01) against the AVX512-VNNI
kernel's tiles (prefetch 0, ``eyas.models.int8_rows.tiles_in_use``), alternating pass by pass.

python scripts/head_cold.py --rows 4 --passes 15
python scripts/head_cold.py --rows 1 --passes 21 --against-q8
python scripts/head_cold.py --rows 1 --passes 40 --dtype bfloat16 --layouts
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import eyas
from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks, quantize_q8_0
from eyas.models.int8_rows import Int8Rows, _kernel, set_prefetch_from_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--distances", default="0,1,2,4,8")
    ap.add_argument("--against-q8", action="store_true", help="int8 against Q8_0 blocks instead of distances")
    ap.add_argument("--layouts", action="store_true", help="plain rows against tiles instead of distances")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    spec = eyas.load(dtype=a.dtype)
    if _kernel() is None:
        raise SystemExit("no int8 head kernel here: needs AVX2 and a C++ toolchain")
    head = spec.drafter.head  # the hybrid drafter's head drafter, or the head itself
    head = getattr(head, "head", head)
    ml = head.midlayer
    mods = {"q|k|v": ml.self_attn.__dict__.get("_eyas_fused"), "o": attached_blocks(ml.self_attn.o_proj),
            "gate|up": ml.mlp.__dict__.get("_eyas_fused"), "down": attached_blocks(ml.mlp.down_proj),
            "lm_head": attached_blocks(head.lm_head)}
    if any(type(m).__name__ != "Int8Rows" for m in mods.values()):
        raise SystemExit("the head's projections are not on the int8 kernel (EYAS_HEAD_INT8=0, or a bf16 head where "
                         "int8 does not pay on this CPU: try --dtype float32)")
    xs = {n: torch.randn(a.rows, m.k).to(getattr(torch, a.dtype)) for n, m in mods.items()}
    flush = torch.zeros(40_000_000)
    if a.layouts:
        if not _kernel().tiles():
            raise SystemExit("this CPU's int8 kernel reads plain rows only (no AVX512-VNNI)")
        as_rows = {n: Int8Rows(m.data, m.scale, m.sums, m.k, tiled=False) for n, m in mods.items()}
        tiled = {n: Int8Rows(m.data, m.scale, m.sums, m.k, tiled=True) for n, m in mods.items()}
        sides = {"rows, prefetch 2": (as_rows, 2), "tiles, prefetch 0": (tiled, 0)}
    elif a.against_q8:
        q8 = {n: GGUFBlocks(data=quantize_q8_0(m.dequantize()), qtype=8, k=m.k) for n, m in mods.items()}
        sides = {"int8 (prefetch 2)": (mods, 2), "Q8_0, float32 block kernel": (q8, 2)}
    else:
        sides = {f"prefetch {d} groups ahead": (mods, int(d)) for d in a.distances.split(",")}
    cold: dict[str, list[float]] = {s: [] for s in sides}
    hot: dict[str, list[float]] = {s: [] for s in sides}
    with torch.inference_mode():
        for _ in range(a.passes):
            for side, (projs, d) in sides.items():
                _kernel().set_prefetch(d)
                flush.add_(1.0)
                for sink in (cold[side], hot[side]):
                    t0 = time.perf_counter()
                    for n, m in projs.items():
                        m.linear(xs[n], None)
                    sink.append(time.perf_counter() - t0)
    set_prefetch_from_env()  # the default again
    print(f"the head's {len(mods)} projections at {a.rows} rows, ms (median of {a.passes}): cold / hot")
    for side in sides:
        print(f"  {side}: {1e3 * statistics.median(cold[side]):6.3f} / {1e3 * statistics.median(hot[side]):6.3f}")


if __name__ == "__main__":
    main()
