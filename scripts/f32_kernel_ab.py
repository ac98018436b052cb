"""A/B of the float32 GGUF-block kernel (eyas/kernels/gguf_f32.cpp): a git revision's build against the working
tree's, on the embedded SmolLM2's 121 block projections, in one process: the outputs must be the same bits, and
the time of a forward's worth of projections by rows (median of interleaved passes; both read the same blocks).

python scripts/f32_kernel_ab.py                        # HEAD's kernel against the working tree's
python scripts/f32_kernel_ab.py --rev 6a42c97 --rows 1,2,4,8,16 --passes 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import eyas
from eyas import kernels
from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks

SOURCES = ("gguf_f32.cpp", "f32_dot.h", "gguf_quants.h", "gguf_f32_wide.h", "torch_ext.h")


def build_revision(rev: str, into: Path):
    """The kernel as it was at ``rev``, compiled with eyas's flags under its own module name (a header ``rev``
    does not have yet is left out: its kernel did not include it).
    """
    for name in SOURCES:
        shown = subprocess.run(["git", "show", f"{rev}:eyas/kernels/{name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            (into / name).write_text(shown.stdout)
    from torch.utils.cpp_extension import load

    cflags, ldflags = kernels.build_flags("gguf_f32")
    return load(f"gguf_f32_{rev.replace('~', '_').replace('^', '_')}", [str(into / "gguf_f32.cpp")],
                extra_cflags=cflags, extra_ldflags=ldflags, build_directory=str(into))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD", help="the revision whose kernel is the baseline")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--passes", type=int, default=7, help="interleaved passes; each times 5 forwards' worth")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        old = build_revision(a.rev, Path(tmp))
        new = kernels.gguf_f32()
        spec = eyas.load(dtype="float32", drafter="none")
        blocks = [b for m in spec.target.model.modules() if isinstance(b := attached_blocks(m), GGUFBlocks)]
        nbytes = sum(b.data.numel() for b in blocks)
        empty = torch.empty(0)
        print(f"{len(blocks)} projections, {nbytes / 1e6:.1f} MB of blocks; {a.rev} against the working tree")
        for r in rows:
            xs = [torch.randn(r, b.k) for b in blocks]
            for b, x in zip(blocks, xs, strict=True):
                if not torch.equal(old.linear(x, b.data, b.qtype, empty), new.linear(x, b.data, b.qtype, empty)):
                    raise SystemExit(f"DIFFERENT bits at {r} rows, blocks {tuple(b.data.shape)} type {b.qtype}")
            times = {"old": [], "new": []}
            for _ in range(a.passes):
                for name, mod in (("old", old), ("new", new)):
                    t0 = time.perf_counter()
                    for _ in range(5):
                        for b, x in zip(blocks, xs, strict=True):
                            mod.linear(x, b.data, b.qtype, empty)
                    times[name].append((time.perf_counter() - t0) / 5)
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{r:3d} rows: {a.rev} {o * 1e3:6.2f} ms ({nbytes / o / 1e9:5.2f} GB/s), working tree "
                  f"{n * 1e3:6.2f} ms ({nbytes / n / 1e9:5.2f} GB/s): {o / n:.2f}x, same bits")


if __name__ == "__main__":
    main()
