"""Exact-mode prefill on the GGUF-block kernel against the dense GEMM it replaced, alternating in one process.

Since the float32 block kernel's AVX-512 build takes any number of rows (``eyas.models.gguf_blocks.f32_any_rows``),
and in bf16 where the kernel runs several rows in FMAs (``eyas.models.gguf_tuning.prefill_on_blocks``), exact mode's
prefill reads the blocks, unpadded. "dense" switches that off for a run (each chunk's projections padded
to the dense GEMM's row floor, MKL, as before). Per prompt: the median prefill time of each over ``--repeats``
alternating runs (plain decoding, one new token; the speculative prefill adds the head's pass over the prompt, the
same on both), and whether both give the same first token. Prompts: the tuning questions (never evaluation sets) and
any ``--prompt``; ``--pad`` repeats each prompt's text to reach longer prompts.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/prefill_ab.py --questions /tmp/tune.jsonl --limit 6 \
    --prompt "Write a short story about a robot learning to paint."
python scripts/prefill_ab.py --questions /tmp/tune.jsonl --limit 4 --pad 3
python scripts/prefill_ab.py --rows 17,32,41,64,96,128   # the layers' 120 projections alone, best of 3 passes
python scripts/prefill_ab.py --rows 8,32,64,128 --dtype bfloat16   # the same for bf16 (oneDNN against the blocks)
python scripts/prefill_ab.py --questions /tmp/tune.jsonl --limit 8 --dtype bfloat16   # bf16 prompts, end to end

``--gemm``: instead, the float32 dense GEMM itself, MKL's ``sgemm`` against the oneDNN product on a prepacked copy
(eyas.models.packed, since 2026-11-30), both on the padded dense path (where the blocks do not take prefill: AVX2).

python scripts/prefill_ab.py --questions /tmp/tune.jsonl --limit 6 --gemm
python scripts/prefill_ab.py --rows 17,40,64,100,128 --gemm   # the layers' 120 projections alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch

import eyas
import eyas.models.exact as exact
from eyas.models import packed
from eyas.models.gguf_blocks import attached_blocks

PAIRS = {False: ("dense", "blocks"), True: ("mkl", "dnnl")}  # (reference, new) by --gemm


@contextmanager
def side_on(side: str):
    """Within: ``side``'s projections: "blocks" as eyas picks them, or the dense GEMM ("dense": as eyas picks it;
    "mkl" / "dnnl": float32's MKL sgemm / oneDNN on a prepacked copy).
    """
    real = exact._f32_any_rows, exact._bf16_any_rows, packed._AVAILABLE_F32
    if side != "blocks":
        exact._f32_any_rows = exact._bf16_any_rows = lambda: False
    if side in ("mkl", "dnnl"):
        packed._AVAILABLE_F32 = real[2] and side == "dnnl"
    try:
        yield
    finally:
        exact._f32_any_rows, exact._bf16_any_rows, packed._AVAILABLE_F32 = real


def prefill_ms(spec, prompt: str, side: str) -> tuple[float, int]:
    """One plain generation of one token with ``side``'s projections (side_on): (prefill ms, first token id)."""
    with side_on(side):
        t0 = time.perf_counter()
        r = spec.generate(prompt, max_new_tokens=1, speculate=False)
        total = time.perf_counter() - t0
    return 1e3 * (r.prefill_seconds or total), r.token_ids[0]


def projections(spec, rows: list[int], gemm: bool = False, passes: int = 3) -> None:
    """The layers' projections (not the vocabulary row) at each row count: the dense GEMM against the blocks (with
    ``gemm``: MKL's float32 GEMM against oneDNN's on the prepacked copy).
    """
    mods = [m for m in spec.target.model.model.layers.modules() if attached_blocks(m) is not None]
    dtype = spec.target.model.dtype
    ref, new = PAIRS[gemm]
    for m in rows:
        xs = [torch.randn(m, mod.in_features).to(dtype) for mod in mods]
        best = {}
        for name in (ref, new):
            runs = []
            with side_on(name):
                for _ in range(passes):
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        for mod, x in zip(mods, xs, strict=True):
                            mod.dense(x) if name != "blocks" else attached_blocks(mod).linear(x, None)
                    runs.append(time.perf_counter() - t0)
            best[name] = 1e3 * min(runs)
        print(f"{m:4d} rows, {len(mods)} projections: {ref} {best[ref]:6.1f} ms  {new} {best[new]:6.1f} ms  "
              f"{best[ref] / best[new]:4.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", default=None)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--prompt", action="append", default=[])
    ap.add_argument("--pad", type=int, default=1, help="repeat each prompt's text this many times")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default=None, help="comma-separated row counts: time the projections alone")
    ap.add_argument("--gemm", action="store_true", help="float32's dense GEMM: MKL against oneDNN prepacked")
    a = ap.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit] if a.questions else []
    prompts = [" ".join([p] * a.pad) for p in [*a.prompt, *prompts]]
    if not prompts and not a.rows:
        ap.error("nothing to time: give --questions, --prompt or --rows")
    spec = eyas.load(dtype=a.dtype)
    if a.rows and not prompts:  # the projections alone: the bf16 kernel takes every row count as well
        projections(spec, [int(r) for r in a.rows.split(",")], a.gemm)
        return
    ref, new = PAIRS[a.gemm]
    if a.gemm and not (packed._AVAILABLE_F32 and a.dtype == "float32"):
        raise SystemExit("--gemm compares float32's dense GEMMs: needs --dtype float32 and oneDNN (EYAS_PACK_WEIGHTS)")
    if not a.gemm and not (exact._f32_any_rows() if a.dtype == "float32" else exact._bf16_any_rows()):
        raise SystemExit("the block kernel does not take prefill here (float32: it needs AVX-512; bfloat16: the "
                         "kernel's fma_rows, eyas.models.gguf_tuning.prefill_on_blocks; and a target with GGUF "
                         "blocks): nothing to compare")
    print(f"exact mode {spec.exact}, dtype {a.dtype}")
    if a.rows:
        projections(spec, [int(r) for r in a.rows.split(",")], a.gemm)
        if not prompts:
            return
    for side in (ref, new):  # warm both paths
        prefill_ms(spec, prompts[0], side)
    totals = {ref: 0.0, new: 0.0}
    for p in prompts:
        times: dict[str, list[float]] = {ref: [], new: []}
        firsts: dict[str, set[int]] = {ref: set(), new: set()}
        for _ in range(a.repeats):
            for side in (ref, new):
                ms, tok = prefill_ms(spec, p, side)
                times[side].append(ms)
                firsts[side].add(tok)
        med = {d: statistics.median(v) for d, v in times.items()}
        for d in med:
            totals[d] += med[d]
        same = "same first token" if firsts[ref] == firsts[new] and len(firsts[ref]) == 1 else f"first {firsts}"
        print(f"{spec.encode(p).shape[0]:5d} tokens  {ref} {med[ref]:7.1f} ms  {new} {med[new]:7.1f} ms  "
              f"{med[ref] / med[new]:4.2f}x  {same}")
    print(f"all prompts: {ref} {totals[ref]:.1f} ms, {new} {totals[new]:.1f} ms, {totals[ref] / totals[new]:.2f}x")

if __name__ == "__main__":
    main()
