"""The compiled tree attention (eyas/kernels/path_attn.cpp) of an earlier commit against the working tree's, in one
process: exact-mode decoding steps of the target verifying a fixed w-node tree (``eyas.autotree``'s timing drafter)
after a prompt of C tokens, median of 12 steps, by width and context, the target's attention swapped between the two
builds round by round (a slow spell of the shared host touches both). Then the kernel alone at the embedded model's
shape (9 query heads, 3 KV heads, 64 dims) by rows and prefix length.

A float32 target on a CPU without AVX-512 ran the portable loop before 2026-11-30 and its own AVX2 body since (other
sums: each build is row-invariant on its own, which is what losslessness needs; tests/models/test_path_kernel.py).

python scripts/attn_ab.py --base HEAD~1
python scripts/attn_ab.py --base HEAD~1 --contexts 160,600 --widths 1,3,6 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_ab import build_base

import eyas
from eyas.autotree import JunkTree, _step_times
from eyas.decode import DecodeConfig, SpecDecoder


def step_table(model, builds: dict, contexts: list[int], widths: list[int], rounds: int) -> None:
    """Median step ms by build, context and width, builds alternating round by round."""
    vocab = model.config.vocab_size
    got: dict[tuple[str, int, int], list[float]] = {(n, c, w): [] for n in builds for c in contexts for w in widths}
    for _ in range(rounds):
        for name, k in builds.items():
            model._path_kernel = k  # the target's attention (eyas.models.native: path_kernel)
            for c in contexts:
                prompt = torch.randint(0, vocab, (c,), generator=torch.Generator().manual_seed(c))
                for w in widths:
                    drafter = JunkTree(w, vocab) if w > 1 else None
                    dec = SpecDecoder(model, drafter, DecodeConfig(max_new_tokens=14, exact=True))
                    got[(name, c, w)].append(statistics.median(_step_times(dec, prompt)))
    print(f"exact-mode step ms (median of 12 steps, best of {rounds} rounds), base / new:")
    for c in contexts:
        cells = []
        for w in widths:
            b, n = (1e3 * min(got[(name, c, w)]) for name in builds)
            cells.append(f"w={w}: {b:.2f} / {n:.2f} ({b / n:.2f}x)")
        print(f"  context {c}: " + ", ".join(cells))


def kernel_table(builds: dict, prefixes: list[int], widths: list[int], rounds: int) -> None:
    """The kernel alone: us a call for ``w`` rows on one chain after a ``p``-slot prefix, SmolLM2's head shape."""
    g = torch.Generator().manual_seed(0)
    hk, h, dh = 3, 9, 64
    k, v = torch.randn(hk, max(prefixes) + 16, dh, generator=g), torch.randn(hk, max(prefixes) + 16, dh, generator=g)
    best = {(n, p, w): float("inf") for n in builds for p in prefixes for w in widths}
    for _ in range(rounds):
        for name, mod in builds.items():
            for p in prefixes:
                for w in widths:
                    q = torch.randn(w, h, dh, generator=g)
                    path, lengths = torch.tensor([[p + j for j in range(w)]] * w), torch.arange(1, w + 1)
                    t = time.perf_counter()
                    for _ in range(50):
                        mod.path_attention(q, k, v, p, path, lengths, dh**-0.5)
                    best[(name, p, w)] = min(best[(name, p, w)], (time.perf_counter() - t) / 50)
    print("the kernel alone, us a call (9 / 3 heads, 64 dims), base / new:")
    for p in prefixes:
        cells = [f"w={w}: {1e6 * best[('base', p, w)]:.1f} / {1e6 * best[('new', p, w)]:.1f}" for w in widths]
        print(f"  prefix {p}: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose path_attn.cpp is the reference")
    ap.add_argument("--contexts", default="160,600")
    ap.add_argument("--widths", default="1,3,6")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    contexts, widths = [int(c) for c in a.contexts.split(",")], [int(w) for w in a.widths.split(",")]
    spec = eyas.load(dtype=a.dtype, drafter="none")
    model = spec.target.model
    new = model.path_kernel()
    if new is None:
        raise SystemExit("needs the compiled tree attention serving the target (a CPU, a float32 cache)")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build_base(a.base, Path(tmp), "path_attn"), "new": new}
        with torch.inference_mode():
            kernel_table(builds, contexts, widths, 3 * a.rounds)
            step_table(model, builds, contexts, widths, a.rounds)
        model._path_kernel = new


if __name__ == "__main__":
    main()
