"""Time a draft head's int8 projections the way a decoding step meets them: weights cold (a verify forward has just
streamed the target's weights through the caches) and hot (the next tree level), by the kernel's software prefetch
distance (``eyas/kernels/head_i8.cpp``: weight groups ahead, 0 off).

Each pass flushes the caches by writing a 160 MB buffer, then runs the head's projections (fused q|k|v, o, fused
gate|up, down, lm_head) once at ``--rows`` rows (the cold call), then once more (the hot call); distances alternate
pass by pass, medians over ``--passes``. Needs a float32 head on the int8 kernel (a CPU with AVX512-VNNI).

python scripts/head_cold.py --rows 4 --passes 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import eyas
from eyas.models.gguf_blocks import attached_blocks
from eyas.models.int8_rows import _kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--distances", default="0,1,2,4,8")
    a = ap.parse_args()
    spec = eyas.load(dtype="float32")
    if _kernel() is None:
        raise SystemExit("no int8 head kernel here: needs AVX512-VNNI and a C++ toolchain")
    head = spec.drafter.head  # the hybrid drafter's head drafter, or the head itself
    head = getattr(head, "head", head)
    ml = head.midlayer
    mods = {"q|k|v": ml.self_attn.__dict__.get("_eyas_fused"), "o": attached_blocks(ml.self_attn.o_proj),
            "gate|up": ml.mlp.__dict__.get("_eyas_fused"), "down": attached_blocks(ml.mlp.down_proj),
            "lm_head": attached_blocks(head.lm_head)}
    if any(type(m).__name__ != "Int8Rows" for m in mods.values()):
        raise SystemExit("the head's projections are not on the int8 kernel (EYAS_HEAD_INT8=0, or a bf16 head)")
    xs = {n: torch.randn(a.rows, m.k) for n, m in mods.items()}
    flush = torch.zeros(40_000_000)
    dists = [int(d) for d in a.distances.split(",")]
    cold: dict[int, list[float]] = {d: [] for d in dists}
    hot: dict[int, list[float]] = {d: [] for d in dists}
    with torch.inference_mode():
        for _ in range(a.passes):
            for d in dists:
                _kernel().set_prefetch(d)
                flush.add_(1.0)
                for sink in (cold[d], hot[d]):
                    t0 = time.perf_counter()
                    for n, m in mods.items():
                        m.linear(xs[n], None)
                    sink.append(time.perf_counter() - t0)
    _kernel().set_prefetch(2)
    print(f"the head's {len(mods)} int8 projections at {a.rows} rows, ms (median of {a.passes}): cold / hot")
    for d in dists:
        print(f"  prefetch {d} groups ahead: {1e3 * statistics.median(cold[d]):6.3f} / "
              f"{1e3 * statistics.median(hot[d]):6.3f}")


if __name__ == "__main__":
    main()
