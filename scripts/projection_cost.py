"""Time the target's block-kernel projections alone, by number of rows (the verify-cost curve without attention,
norms or Python around them): all 121 GGUF-block projections of the embedded SmolLM2, best of 3 passes of 20.

python scripts/projection_cost.py [--rows 1,2,3,4,5,6,8]      # ms per forward's worth of projections, by rows
python scripts/projection_cost.py --dtype float32              # and the same projections on their dense weights
"""

from __future__ import annotations

import argparse
import time

import torch

import eyas
from eyas.models.gguf_blocks import attached_blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: also time the dense weights on the streaming kernel (the path the blocks replace)")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    dtype = getattr(torch, a.dtype)
    spec = eyas.load(dtype=a.dtype, drafter="none")
    mods = [m for m in spec.target.model.modules() if attached_blocks(m) is not None]
    if not mods:
        raise SystemExit(f"no GGUF-block projections in {a.dtype}: needs the embedded GGUF target and, for bf16, "
                         "a CPU with AVX512-BF16")
    xs = {r: [torch.randn(r, m.weight.shape[1]).to(dtype) for m in mods] for r in rows}
    paths = {"blocks": lambda m, x: attached_blocks(m).linear(x, None)}
    if dtype == torch.float32:
        from eyas.models.packed import skinny_kernel

        paths["dense"] = lambda m, x: skinny_kernel(m.weight, x).linear(x, m.weight, torch.empty(0))
    with torch.inference_mode():
        for name, fn in paths.items():
            print(f"{len(mods)} projections ({name}, {a.dtype}), ms by rows:", _time(mods, xs, fn, a.repeats))


def _time(mods, xs, fn, repeats: int) -> dict[int, float]:
    best: dict[int, float] = {}
    for _ in range(3):
        for r, xr in xs.items():
            def run(xr=xr) -> None:
                for m, x in zip(mods, xr, strict=True):
                    fn(m, x)
            run()
            t = time.perf_counter()
            for _ in range(repeats):
                run()
            best[r] = min(best.get(r, float("inf")), (time.perf_counter() - t) / repeats * 1e3)
    return {r: round(v, 3) for r, v in best.items()}


if __name__ == "__main__":
    main()
