"""Time the target's block-kernel projections alone, by number of rows (the verify-cost curve without attention,
norms or Python around them): all 121 GGUF-block projections of the embedded SmolLM2 in bf16, best of 3 passes of 20.

python scripts/projection_cost.py [--rows 1,2,3,4,5,6,8]      # ms per forward's worth of projections, by rows
"""

from __future__ import annotations

import argparse
import time

import torch

import eyas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    spec = eyas.load(dtype="bfloat16", drafter="none")
    mods = [m for m in spec.target.model.modules() if "_eyas_blocks" in m.__dict__]
    if not mods:
        raise SystemExit("no GGUF-block projections: needs a CPU with AVX512-BF16 and the embedded GGUF target")
    xs = {r: [torch.randn(r, m.weight.shape[1]).bfloat16() for m in mods] for r in rows}
    best: dict[int, float] = {}
    with torch.inference_mode():
        for _ in range(3):
            for r in rows:
                def run(r=r) -> None:
                    for m, x in zip(mods, xs[r], strict=True):
                        m.__dict__["_eyas_blocks"].linear(x, None)
                run()
                t = time.perf_counter()
                for _ in range(a.repeats):
                    run()
                best[r] = min(best.get(r, float("inf")), (time.perf_counter() - t) / a.repeats * 1e3)
    print(f"{len(mods)} projections, ms by rows:", {r: round(v, 3) for r, v in best.items()})


if __name__ == "__main__":
    main()
