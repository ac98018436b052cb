"""One draft-head call (an extension: the fused taps, the head over 2 rows, the last row's log-probs and top-2)
timed the way a decoding step meets it: first after the target's block projections (one forward's weight stream: the
call's code, torch's and the head's weights back from DRAM) and in a hot loop, through the native call
(eyas.drafters.head_step) and through the torch fast path, alternating round by round in one process.

python scripts/head_step_cold.py --rounds 3 --passes 40
python scripts/head_step_cold.py --base HEAD~1 --level 3   # also the native call built from HEAD~1's kernels; each
                                                           # call then one tree level of 3 rows (3 log-prob rows)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import eyas
from eyas.drafters.base import TargetFeatures
from eyas.models.decode_plan import DecodePlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--base", default=None, help="a revision: also time the native call built from its kernels")
    ap.add_argument("--level", type=int, default=0, help="after the extension, a tree level of this many rows")
    a = ap.parse_args()
    spec = eyas.load(dtype="bfloat16")
    model = spec.target.model
    plan = DecodePlan.build(model)
    drafter = spec.drafter.head  # the hybrid drafter's EAGLE-3 drafter
    step = drafter.step
    if plan is None or step is None:
        raise SystemExit("needs the embedded GGUF target in bf16 with its decode plan and the native head call "
                         "(a CPU with AVX512-BF16, the kernels built, EYAS_HEAD_STEP not 0)")
    d, i = model.config.hidden_size, model.config.intermediate_size
    projs = [(p, k) for layer in plan.layers for p, k in ((layer.qkv, d), (layer.o, d), (layer.gate_up, d),
                                                          (layer.down, i))]
    xs = [torch.randn(1, k).bfloat16() for _, k in projs]
    taps = torch.randn(len(drafter.taps), 2, d).bfloat16()
    feats = TargetFeatures(hidden=taps[0], taps={layer: taps[j] for j, layer in enumerate(drafter.taps)})
    tokens = [5, 77]
    drafter.start(512)
    arms = [("torch", None), ("native", step)]
    if a.base:
        arms.append((f"@{a.base}", base_step(a.base, drafter, model.model.embed_tokens)))

    def forward() -> None:
        for (p, _), x in zip(projs, xs, strict=True):
            plan.blocks.linear(x, p.data, p.code, p.bias)

    def call() -> None:  # as EagleDrafter.extend, then the first tree level's top-k
        native_taps = drafter._native_taps(feats)
        hid = None if native_taps else drafter._feature_in(feats)
        out = drafter._fast_call(tokens, hid, None, 100, 1, 100, 100, [[0], [0, 1]], 1, native_taps)
        if out.top is None:  # the torch path: the tree's top-k as the expansion takes it
            out.logp[-1].topk(2)
        if a.level:  # as a tree level: each row one node below the extension's last row, all log-prob rows
            n = a.level
            lv = drafter._fast_call(list(range(7, 7 + n)), out.hidden, [1] * n, 102, 0, 102, 100,
                                    [[0, 1, 2 + j] for j in range(n)], 0)
            if lv.top is None:
                lv.logp.topk(2)

    out: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for path, native in arms:
                drafter.step = native
                for when, prelude in (("first after the projections", forward), ("hot loop", lambda: None)):
                    times = []
                    for _ in range(a.passes):
                        prelude()
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    out.setdefault((path, when), []).append(1e6 * statistics.median(times))
    drafter.step = step
    print(f"us a call (median of {a.passes} passes, each round):")
    for (path, when), v in out.items():
        print(f"  {path:7s} {when:28s} " + " ".join(f"{x:7.0f}" for x in v))


def base_step(rev: str, drafter, embedding):
    """The drafter's native call built from the kernels at ``rev`` (scripts/kernel_ab.py's build)."""
    import tempfile
    from pathlib import Path

    from kernel_ab import build_base

    from eyas.drafters import head_step

    tmp = Path(tempfile.mkdtemp(prefix="head_step_base_"))
    lazy = head_step._kernel
    saved, lazy.value = lazy.value, build_base(rev, tmp, "head_step")
    try:
        return head_step.HeadStep.build(drafter.head, embedding)
    finally:
        lazy.value = saved


if __name__ == "__main__":
    main()
