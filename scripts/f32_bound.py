"""Is the float32 block kernel (eyas/kernels/gguf_f32.cpp) bound by memory or by its own instructions on this CPU?

Times one [1536, 576] Q4_1 projection (SmolLM2's gate or up) at each row count two ways: the same weight again and
again (it stays in L2) and 180 distinct weights in turn (~100 MB, streamed from DRAM as a decode step streams the
model). Where both run at the same rate the kernel is compute-bound: a faster memory would not help it, fewer
instructions a weight would. Random quants with a fixed scale and minimum; only the speed is looked at.

python scripts/f32_bound.py --rows 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas import kernels

K, N, Q4_1, BLOCK_BYTES = 576, 1536, 3, 20


def random_blocks(g: torch.Generator) -> torch.Tensor:
    """[N, K / 32 * 20] uint8 Q4_1 blocks: fp16 scale 0x1413 (~1e-3), minimum its negative, random nibbles."""
    w = torch.randint(0, 256, (N, K // 32, BLOCK_BYTES), dtype=torch.uint8, generator=g)
    w[:, :, 0:4] = torch.tensor([0x13, 0x14, 0x13, 0x94], dtype=torch.uint8)
    return w.reshape(N, K // 32 * BLOCK_BYTES).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    k = kernels.gguf_f32()
    if k is None or not k.available():
        raise SystemExit("the float32 block kernel is not built here (needs AVX2, FMA and F16C)")
    g = torch.Generator().manual_seed(0)
    warm, cold = [random_blocks(g)], [random_blocks(g) for _ in range(180)]
    empty = torch.empty(0)
    print(f"[{N}, {K}] Q4_1, {torch.get_num_threads()} threads: G multiply-adds/s (GB/s of blocks)")
    with torch.inference_mode():
        for r in (int(x) for x in a.rows.split(",")):
            x = torch.randn(r, K, generator=g)
            cells = []
            for name, ws, reps in (("L2", warm, 400), ("DRAM", cold, 3)):
                best = float("inf")
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    for _ in range(reps):
                        for w in ws:
                            k.linear(x, w, Q4_1, empty)
                    best = min(best, (time.perf_counter() - t) / (reps * len(ws)))
                cells.append(f"{name} {r * N * K / best / 1e9:5.1f} ({N * K * BLOCK_BYTES / 32 / best / 1e9:4.1f})")
            print(f"  {r} rows: " + "   ".join(cells))


if __name__ == "__main__":
    main()
