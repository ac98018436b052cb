"""The bf16 GGUF-block kernel of an earlier commit against the working tree's, in one process: the embedded SmolLM2's
121 block projections (the weights streaming from memory, as in a forward) by number of rows, the two builds
alternating round by round (a slow spell of the shared host touches both), best of the rounds; then every output of
the last width compared bit for bit (a speed change must not change a sum).

python scripts/kernel_ab.py --base HEAD~1                                  # ms by rows, old / new / ratio
python scripts/kernel_ab.py --base HEAD~1 --rows 2,3,4 --tuning 0,0 --base-tuning 0,0 --rounds 14
python scripts/kernel_ab.py --base HEAD~1 --steps                        # whole exact-mode decoding steps instead

``--steps``: the target's exact-mode decoding steps verifying a fixed w-node tree (``eyas.autotree``'s timing
drafter, 160 prompt tokens), median of 12 steps, w = 1 (plain decoding's step) and each ``--rows`` width, the
process's block kernel swapped between the two builds round by round: what a verify forward costs end to end
(attention, norms, Python included), without the noise of comparing two processes. The steps run the decode
plan's Python loop (``EYAS_DECODE_STEP=0``): the native decode call holds its own copy of the working tree's kernel.

``--tuning`` / ``--base-tuning``: PREFETCH,PAIR[,FMA[,PREFETCH_ONE[,FUSED]]] as ``EYAS_GGUF_TUNING`` (default: what eyas
picks for this machine, for both). The earlier source is built with eyas's own flags into a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import eyas
from eyas import kernels
from eyas.autotree import CONTEXT, JunkTree, _step_times
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.models import gguf_blocks, gguf_tuning
from eyas.models.gguf_blocks import attached_blocks


def build_base(rev: str, tmp: Path, kernel: str = "gguf_bf16"):
    """eyas/kernels/<kernel>.cpp and the headers beside it as of ``rev``, built as eyas builds its own (also
    scripts/attn_ab.py's).
    """
    from torch.utils.cpp_extension import load

    source = f"eyas/kernels/{kernel}.cpp"
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "eyas/kernels/"], check=True, capture_output=True,
                           text=True).stdout.split()
    for name in [n for n in names if n.endswith(".h")] + [source]:
        (tmp / Path(name).name).write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], check=True,
                                                           capture_output=True).stdout)
    cflags, ldflags = kernels.build_flags(kernel)
    return load(f"eyas_{kernel}_base", [str(tmp / f"{kernel}.cpp")], build_directory=str(tmp), verbose=False,
                extra_cflags=cflags, extra_ldflags=ldflags)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision whose gguf_bf16.cpp is the reference")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tuning", help="PREFETCH,PAIR[,FMA[,ONE[,FUSED]]], the tree's build (default: eyas's)")
    ap.add_argument("--base-tuning", help="PREFETCH,PAIR[,FMA[,ONE[,FUSED]]], the base build (default: eyas's)")
    ap.add_argument("--steps", action="store_true", help="time exact-mode decoding steps by tree width instead")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if a.steps:  # the steps' projections through the swapped module, not the native decode call's own copy
        os.environ["EYAS_DECODE_STEP"] = "0"
    spec = eyas.load(dtype="bfloat16", drafter="none")  # applies this machine's tuning to the working tree's build
    new = kernels.gguf_bf16()
    blocks = [b for m in spec.target.model.modules() if (b := attached_blocks(m)) is not None]
    if new is None or not new.available() or not blocks:
        raise SystemExit("needs AVX512-BF16 and the embedded GGUF target's block projections")
    chosen = gguf_tuning.active()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(a.base, Path(tmp))
        builds = {"base": base, "new": new}
        tunings = {"base": gguf_tuning.KernelTuning.parse(a.base_tuning) if a.base_tuning else chosen,
                   "new": gguf_tuning.KernelTuning.parse(a.tuning) if a.tuning else chosen}
        if a.steps:
            return time_steps(spec.target.model, builds, tunings, sorted({1, *rows}), a.rounds)
        xs = {r: [torch.randn(r, b.k, generator=torch.Generator().manual_seed(r)).bfloat16() for b in blocks]
              for r in rows}
        empty = torch.empty(0)
        operands = {name: [b.layout_for(k) for b in blocks] for name, k in builds.items()}
        best = {(name, r): float("inf") for name in builds for r in rows}
        with torch.inference_mode():
            for _ in range(a.rounds):
                for name, k in builds.items():
                    gguf_tuning.set_on(k, tunings[name])
                    for r in rows:
                        t = time.perf_counter()
                        for _ in range(a.repeats):
                            for (data, code), x in zip(operands[name], xs[r], strict=True):
                                k.linear(x, data, code, empty)
                        best[(name, r)] = min(best[(name, r)], (time.perf_counter() - t) / a.repeats)
            same = all(torch.equal(base.linear(x, *old, empty).view(torch.int16),
                                   new.linear(x, *now, empty).view(torch.int16))
                       for old, now, x in zip(operands["base"], operands["new"], xs[rows[-1]], strict=True))
    print(f"{len(blocks)} projections, ms by rows (best of {a.rounds} rounds x {a.repeats}):")
    for name in builds:
        print(f"  {name:4} {a.base if name == 'base' else 'tree':>8} {tunings[name]}:",
              {r: round(best[(name, r)] * 1e3, 2) for r in rows})
    print("  new / base:", {r: round(best[("new", r)] / best[("base", r)], 3) for r in rows})
    print(f"  outputs at {rows[-1]} rows bit-identical: {same}")
    if not same:
        raise SystemExit(1)


def time_steps(model, builds: dict, tunings: dict, widths: list[int], rounds: int) -> None:
    """Median exact-mode step seconds verifying a ``w``-node tree, by build and width, builds alternating."""
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))

    def median_step(width: int) -> float:
        drafter = JunkTree(width, model.config.vocab_size) if width > 1 else None
        dec = SpecDecoder(model, drafter, DecodeConfig(max_new_tokens=14, exact=True))
        return statistics.median(_step_times(dec, prompt))

    got: dict[tuple[str, int], list[float]] = {(name, w): [] for name in builds for w in widths}
    for _ in range(rounds):
        for name, k in builds.items():
            gguf_blocks._kernel.value = k  # every block projection of the process now runs on this build
            for mod in model.modules():  # ... in its own layout, made again at the first call
                if (b := attached_blocks(mod)) is not None:
                    b.__dict__.pop("_packed", None)
            model.__dict__.pop("_decode_plan", None)  # and the plan, which holds the kernel and the layouts
            gguf_tuning.set_on(k, tunings[name])
            median_step(widths[0])  # warm-up after the swap
            for w in widths:
                got[(name, w)].append(median_step(w))
    ms = {key: statistics.median(v) * 1e3 for key, v in got.items()}
    print(f"exact-mode decoding step, ms by tree width (median of {rounds} rounds' medians of 12 steps):")
    for name in builds:
        print(f"  {name:4} {tunings[name]}:", {w: round(ms[(name, w)], 2) for w in widths},
              " over 1 node:", {w: round(ms[(name, w)] - ms[(name, 1)], 2) for w in widths[1:]})
    print("  new / base:", {w: round(ms[("new", w)] / ms[("base", w)], 3) for w in widths})


if __name__ == "__main__":
    main()
