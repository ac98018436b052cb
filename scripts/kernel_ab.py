"""The bf16 GGUF-block kernel of an earlier commit against the working tree's, in one process: the embedded SmolLM2's
121 block projections (the weights streaming from memory, as in a forward) by number of rows, the two builds
alternating round by round (a slow spell of the shared host touches both), best of the rounds; then every output of
the last width compared bit for bit (a speed change must not change a sum).

python scripts/kernel_ab.py --base HEAD~1                                  # ms by rows, old / new / ratio
python scripts/kernel_ab.py --base HEAD~1 --rows 2,3,4 --tuning 0,0 --base-tuning 0,0 --rounds 14

``--tuning`` / ``--base-tuning``: PREFETCH,PAIR as ``EYAS_GGUF_TUNING`` (default: what eyas picks for this machine,
for both). The earlier source is built with eyas's own flags into a temporary directory.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import eyas
from eyas import kernels
from eyas.models import gguf_tuning

KERNEL = "eyas/kernels/gguf_bf16.cpp"


def build_base(rev: str, tmp: Path):
    """gguf_bf16.cpp and the headers beside it as of ``rev``, built as eyas builds its own."""
    from torch.utils.cpp_extension import load

    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "eyas/kernels/"], check=True, capture_output=True,
                           text=True).stdout.split()
    for name in [n for n in names if n.endswith(".h")] + [KERNEL]:
        (tmp / Path(name).name).write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], check=True,
                                                           capture_output=True).stdout)
    return load("eyas_gguf_bf16_base", [str(tmp / "gguf_bf16.cpp")], build_directory=str(tmp), verbose=False,
                extra_cflags=[*kernels._FLAGS, "-ffp-contract=off"], extra_ldflags=kernels._LDFLAGS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision whose gguf_bf16.cpp is the reference")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tuning", help="PREFETCH,PAIR for the working tree's build (default: eyas's choice)")
    ap.add_argument("--base-tuning", help="PREFETCH,PAIR for the base build (default: eyas's choice)")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    spec = eyas.load(dtype="bfloat16", drafter="none")  # applies this machine's tuning to the working tree's build
    new = kernels.gguf_bf16()
    blocks = [m.__dict__["_eyas_blocks"] for m in spec.target.model.modules() if "_eyas_blocks" in m.__dict__]
    if new is None or not new.available() or not blocks:
        raise SystemExit("needs AVX512-BF16 and the embedded GGUF target's block projections")
    chosen = gguf_tuning.active()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(a.base, Path(tmp))
        builds = {"base": base, "new": new}
        tunings = {"base": gguf_tuning.KernelTuning.parse(a.base_tuning) if a.base_tuning else chosen,
                   "new": gguf_tuning.KernelTuning.parse(a.tuning) if a.tuning else chosen}
        xs = {r: [torch.randn(r, b.k, generator=torch.Generator().manual_seed(r)).bfloat16() for b in blocks]
              for r in rows}
        empty = torch.empty(0)
        best = {(name, r): float("inf") for name in builds for r in rows}
        with torch.inference_mode():
            for _ in range(a.rounds):
                for name, k in builds.items():
                    k.set_tuning(tunings[name].prefetch, tunings[name].pair_as_triple)
                    for r in rows:
                        t = time.perf_counter()
                        for _ in range(a.repeats):
                            for b, x in zip(blocks, xs[r], strict=True):
                                k.linear(x, b.data, b.qtype, empty)
                        best[(name, r)] = min(best[(name, r)], (time.perf_counter() - t) / a.repeats)
            same = all(torch.equal(base.linear(x, b.data, b.qtype, empty).view(torch.int16),
                                   new.linear(x, b.data, b.qtype, empty).view(torch.int16))
                       for b, x in zip(blocks, xs[rows[-1]], strict=True))
    print(f"{len(blocks)} projections, ms by rows (best of {a.rounds} rounds x {a.repeats}):")
    for name in builds:
        print(f"  {name:4} {a.base if name == 'base' else 'tree':>8} {tunings[name]}:",
              {r: round(best[(name, r)] * 1e3, 2) for r in rows})
    print("  new / base:", {r: round(best[("new", r)] / best[("base", r)], 3) for r in rows})
    print(f"  outputs at {rows[-1]} rows bit-identical: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
