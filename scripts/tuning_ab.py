"""Two settings of the bf16 block kernel (eyas.models.gguf_tuning), each with its own tree, in one process.

The kernel's choices are process-wide, so `head_ab.py --later-env EYAS_GGUF_TUNING=...` cannot compare them: here one
target serves both arms and the setting is applied before each arm's question (speculative, then plain under the same
setting), the order rotating question by question. Each arm's tree is what eyas sized under that setting (the
`tree_used` of its `--json`, or `tree_choice.tree`); pass the same tree twice to compare the kernel alone. Prints
decode tok/s (prefill excluded), τ, ms a step, each arm's speculative / plain ratio and the second arm against the
first.
Tuning questions only, never evaluation sets.

python scripts/tuning_ab.py --questions /tmp/tune.jsonl --limit 16 \
    --first 0,0,0,1,1 --first-tree adaptive:3,6,0.637,0.674/0.733/0.753/1.24/1.73/1.81/1.9 \
    --second 1,0,0,1,1 --second-tree adaptive:2,6,0.441,0.293/0.538/0.698/1.13/1.55/1.62/1.68
"""

from __future__ import annotations

import argparse
import json

from head_ab import Arm

import eyas
from eyas.models import gguf_tuning
from eyas.models.gguf_blocks import block_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--first", required=True,
                    help="as EYAS_GGUF_TUNING: PREFETCH,PAIR[,FMA[,PREFETCH_ONE[,FUSED]]]")
    ap.add_argument("--second", required=True)
    ap.add_argument("--first-tree", default=None, help="default: the tree eyas sizes at load")
    ap.add_argument("--second-tree", default=None)
    a = ap.parse_args()

    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    kernel = block_kernel()
    if kernel is None:
        raise SystemExit("the bf16 block kernel does not run on this CPU (no AVX512-BF16): nothing to compare")
    arms = []
    for name, text, tree in (("first", a.first, a.first_tree), ("second", a.second, a.second_tree)):
        tuning = gguf_tuning.KernelTuning.parse(text)
        spec = eyas.load(dtype="bfloat16", tree=tree)
        gguf_tuning.apply(kernel, tuning)
        spec.generate(qs[0], max_new_tokens=16)  # warm-up under this setting
        spec.generate(qs[0], max_new_tokens=16, speculate=False)
        label = f"{name} {text} {spec.drafter_spec.tree}"
        arms.append((tuning, spec, Arm(label), Arm(f"plain under {name}")))
    for i, q in enumerate(qs):
        for tuning, spec, arm, plain in arms if i % 2 == 0 else arms[::-1]:
            gguf_tuning.apply(kernel, tuning)
            arm.add(spec.generate(q, max_new_tokens=a.max_new_tokens))
            plain.add(spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False))
    for _, _, arm, plain in arms:
        print(f"{arm.name}\n  decode {arm.tok_s:6.1f} tok/s  tau {arm.tau:.3f}  {arm.ms_a_step:6.2f} ms a step  "
              f"plain {plain.tok_s:6.1f} tok/s  speculative / plain x{arm.tok_s / plain.tok_s:.3f}")
    (_, _, s1, p1), (_, _, s2, p2) = arms
    print(f"second / first: speculative x{s2.tok_s / s1.tok_s:.3f}, plain x{p2.tok_s / p1.tok_s:.3f}")


if __name__ == "__main__":
    main()
