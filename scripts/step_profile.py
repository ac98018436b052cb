"""Where a decoding step's time goes, plain against speculative, on tuning questions (never evaluation sets).

Wraps SpecDecoder's three verbs (draft, verify_forward, accept) with timers, runs plain decoding then the drafter
over the same questions in one process, and prints ms per step of each, tau, the step ratio and decode tok/s
(prefill excluded). ``--tree`` fixes the tree; without it eyas sizes one at load (eyas.autotree). ``--parts`` also
times the default drafter's pieces (the head's extension over accepted tokens and its tree levels, its calls,
layer, fused taps, embedding and vocabulary head, the tree's bookkeeping, the lookup merge) and the verify forward by
tree size, with its block-kernel projections and path attention (those two only with ``EYAS_DECODE_STEP=0``: a bf16
target's layers otherwise run as one native call, eyas/kernels/decode_step.cpp, whose kernel calls no Python wrapper
sees).
Nested pieces are inside their callers' times; calls during prefill are left out; the timers cost a few
microseconds a call.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/step_profile.py --questions /tmp/tune.jsonl --limit 12 --tree dynamic:2,1,2
python scripts/step_profile.py --questions /tmp/tune.jsonl --limit 6 --max-new-tokens 128 --parts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import eyas
from eyas.decode import SpecDecoder
from eyas.drafters.eagle import EagleDrafter
from eyas.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from eyas.drafters.expansion import DynamicExpansion
from eyas.drafters.hybrid import HybridDrafter
from eyas.models.gguf_blocks import GGUFBlocks

VERBS = ("draft", "verify_forward", "accept")
# (class, method, label): the default drafter's pieces, outermost first
PARTS = (
    (HybridDrafter, "extend", "head: extend over accepted tokens"),
    (Eagle3Head, "fuse", "  fc over the target's taps"),
    (EagleDrafter, "_embed", "  embedding (extend and levels)"),
    (EagleDrafter, "_fast_call", "  head calls (extend and levels; native where it serves)"),
    (Eagle3Head, "fast_forward", "  layer (extend and levels)"),
    (Eagle3Drafter, "_logp", "  vocabulary head + log-softmax (all)"),
    (HybridDrafter, "propose", "head: propose (levels, tree, lookup merge)"),
    (EagleDrafter, "_run_feed", "  one more tree level"),
    (DynamicExpansion, "start", "  tree: first level"),
    (DynamicExpansion, "grow", "  tree: grow"),
)


IN_PREFILL = [False]  # set while SpecDecoder.prefill runs: its calls are not a decoding step's


def wrap(cls, name: str, sink: list[float], sizes: defaultdict | None = None, when=lambda: True) -> None:
    """Replace cls.name by a timed copy appending seconds to ``sink`` (and, for verify_forward(seq, tree), by tree
    size to ``sizes``) for calls outside prefill where ``when()`` holds.
    """
    real = getattr(cls, name)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        dt = time.perf_counter() - t0
        if IN_PREFILL[0] or not when():
            return out
        sink.append(dt)
        if sizes is not None:
            sizes[args[2].num_nodes].append(dt)
        return out

    setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", action="store_true", help="also time the drafter's pieces and verify by tree size")
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    spec = eyas.load(dtype=a.dtype, tree=a.tree)
    print("tree", spec.drafter_spec.tree, spec.tree_choice)
    times: dict[str, list[float]] = {name: [] for name in VERBS}
    by_size: defaultdict[int, list[float]] = defaultdict(list)
    for name in VERBS:
        wrap(SpecDecoder, name, times[name], by_size if name == "verify_forward" else None)
    parts: dict[str, list[float]] = {}
    verify_pieces: defaultdict[int, list[tuple[float, float]]] = defaultdict(list)
    real_prefill = SpecDecoder.prefill

    def prefill(self, *args, **kw):
        IN_PREFILL[0] = True
        try:
            return real_prefill(self, *args, **kw)
        finally:
            IN_PREFILL[0] = False

    SpecDecoder.prefill = prefill
    if a.parts:
        for cls, name, label in PARTS:
            parts[label] = []
            wrap(cls, name, parts[label])
        parts["  head's block-kernel projections (all)"] = kernel = []
        head_kernel(kernel)
        verify_pieces = verify_kernels()
    spec.generate(qs[0], max_new_tokens=16)
    spec.generate(qs[0], max_new_tokens=16, speculate=False)
    rows = {}
    for speculate in (False, True):
        for v in (*times.values(), *parts.values()):
            v.clear()
        by_size.clear()
        verify_pieces.clear()
        secs = tokens = steps = accepted = 0
        for q in qs:
            r = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=speculate)
            secs += r.seconds - r.prefill_seconds
            tokens += r.new_tokens - 1
            steps, accepted = steps + r.steps, accepted + r.accepted
        ms = {k: 1e3 * sum(v) / len(v) for k, v in times.items()}
        rows[speculate] = (ms, tokens / secs, 1 + accepted / max(steps, 1))
        label = "speculative" if speculate else "plain"
        print(f"{label:12s} ms per step {({k: round(v, 2) for k, v in ms.items()})} sum {sum(ms.values()):.2f}")
        if a.parts:
            sizes = ", ".join(f"{n}: {1e3 * statistics.median(v):.2f} ({len(v)})" for n, v in sorted(by_size.items()))
            print(f"  verify forward by tree size, median ms (steps): {sizes}")
            med = {n: [1e3 * statistics.median(x) for x in zip(*v, strict=True)] for n, v in verify_pieces.items()}
            pieces = ", ".join(f"{n}: {p:.2f} / {t:.2f} / {o:.2f}" for n, (p, t, o) in sorted(med.items()))
            print(f"  of it, the target's block-kernel projections / path attention / output screen, median ms: "
                  f"{pieces}")
            if os.environ.get("EYAS_DECODE_STEP", "1") != "0":
                print("  (a bf16 target's projections and attention run inside one native call, not timed apart: "
                      "EYAS_DECODE_STEP=0 times them)")
        if a.parts and speculate:
            for k, v in parts.items():
                print(f"  {k:44s} {1e3 * sum(v) / steps:6.2f} ms a step, {len(v) / steps:4.2f} calls")
    (pm, ptps, _), (sm, stps, tau) = rows[False], rows[True]
    print(f"tau {tau:.2f}  step/plain {sum(sm.values()) / sum(pm.values()):.2f}  decode tok/s plain {ptps:.1f} "
          f"speculative {stps:.1f}  speedup {stps / ptps:.2f}")


def verify_kernels() -> defaultdict[int, list[tuple[float, float, float]]]:
    """Per verify forward outside prefill, by tree size: (s in the target's block-kernel projections, s in its path
    attention with RoPE and the cache write, s in the output screen with its exact candidates) -- what a verify row
    costs beyond a plain token, split.
    """
    from eyas import kernels
    from eyas.models.lm_screen import ArgmaxScreen

    current, proj, attn, screen = [0], [], [], []
    out: defaultdict[int, list[tuple[float, float, float]]] = defaultdict(list)
    # the compiled modules' functions: the target's modules and its decode plan (eyas.models.decode_plan) both call
    # them through the module at every call
    for blocks in {kernels.gguf_bf16(), kernels.gguf_f32()} - {None}:  # bf16 and float32 targets' block kernels
        wrap(blocks, "linear", proj, when=lambda: current[0] > 0)
    wrap(kernels.LAYER_OPS(), "rope_cache", attn, when=lambda: current[0] > 0)
    wrap(kernels.path_attention(), "path_attention", attn, when=lambda: current[0] > 0)
    wrap(ArgmaxScreen, "logits", screen, when=lambda: current[0] > 0)
    outer = SpecDecoder.verify_forward

    def verify_forward(self, seq, tree):
        current[0], p0, a0, s0 = tree.num_nodes, len(proj), len(attn), len(screen)
        try:
            return outer(self, seq, tree)
        finally:
            current[0] = 0
            if not IN_PREFILL[0]:
                out[tree.num_nodes].append((sum(proj[p0:]), sum(attn[a0:]), sum(screen[s0:])))

    SpecDecoder.verify_forward = verify_forward
    return out


def head_kernel(sink: list[float]) -> None:
    """Time GGUFBlocks.linear calls made inside the drafter (the head's Q8_0 projections), not the target's."""
    inside = [0]
    wrap(GGUFBlocks, "linear", sink, when=lambda: inside[0] > 0)
    for name in ("extend", "propose"):
        outer = getattr(HybridDrafter, name)

        def flagged(*args, _outer=outer, **kw):
            inside[0] += 1
            try:
                return _outer(*args, **kw)
            finally:
                inside[0] -= 1

        setattr(HybridDrafter, name, flagged)


if __name__ == "__main__":
    main()
