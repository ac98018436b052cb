"""Draft heads compared in one process, question by question, with the same tree (and plain decoding beside them).

Each head is loaded as the default drafter's head (the hybrid tree: head plus prompt lookup) on one shared target
process; every question is decoded by each head in a rotating order, then plainly, so a host that slows down during
the run slows every arm alike. Prints decode tok/s (prefill excluded), tau (pooled), ms a step and each head's
speed relative to the first. Use the shipped head first; a head whose function equals it (e.g. one widened by
`eyas train --widen-mlp` before training) measures pure drafting cost. Tuning questions only, never evaluation sets.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/head_ab.py --questions /tmp/tune.jsonl --limit 16 eyas/heads/smollm2-135m-instruct-eagle3 /tmp/other
# one head under two kernel settings: the first arm as the environment says, the second with --later-env set
EYAS_HEAD_INT8=0 python scripts/head_ab.py --questions /tmp/tune.jsonl --limit 24 --dtype float32 \
    --later-env EYAS_HEAD_INT8=auto eyas/heads/smollm2-135m-instruct-eagle3 eyas/heads/smollm2-135m-instruct-eagle3
# a setting of the target's kernels: plain decoding under each arm too, and each arm's ratio
python scripts/head_ab.py --questions /tmp/tune.jsonl --limit 24 --later-env EYAS_LM_SCREEN_PREFETCH=0 --plain-each H H
# one head, the first arm's native head call built from an earlier revision's kernels (from the repository root)
python scripts/head_ab.py --questions /tmp/tune.jsonl --limit 24 --base-step HEAD~1 H H
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass
class Arm:
    """One side of an A/B: decode seconds and tokens (prefill left out), steps and accepted drafts, summed."""

    name: str
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0

    def add(self, r) -> None:
        self.seconds += r.seconds - r.prefill_seconds
        self.tokens += r.new_tokens - 1  # the first token comes from prefill
        self.steps += r.steps
        self.accepted += r.accepted

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def tau(self) -> float:
        return 1 + self.accepted / max(self.steps, 1)

    @property
    def ms_a_step(self) -> float:
        return 1e3 * self.seconds / max(self.steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("heads", nargs="+", help="head directories; the first is the reference")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default=None, help="default: the tree eyas sizes for the first head")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--later-tree", default=None,
                    help="the tree of every head after the first (compare trees on one head); default: the first's")
    ap.add_argument("--later-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set while loading every head after the first (compare kernel settings on one head)")
    ap.add_argument("--plain-each", action="store_true",
                    help="plain decoding on every arm's target too (a --later-env setting that changes the target)")
    ap.add_argument("--base-step", default=None, metavar="REV",
                    help="the first head's native call built from REV's kernels (compare a head_step.cpp change)")
    a = ap.parse_args()
    # settings a process takes once (a later load keeps the first's, so both arms would run one): the block kernel's
    # options, and the output screen's switch (its kernel is looked up once; checked: the second load still screened)
    for name in {kv.split("=", 1)[0] for kv in a.later_env} & {"EYAS_GGUF_TUNING", "EYAS_LM_SCREEN"}:
        fix = "scripts/tuning_ab.py" if name == "EYAS_GGUF_TUNING" else "two processes, alternating"
        ap.error(f"{name} cannot differ between arms of one process (it is read once); use {fix}")
    import os

    import eyas

    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    first = eyas.load(dtype=a.dtype, drafter="hybrid", head=a.heads[0], tree=a.tree)
    tree = first.drafter_spec.tree
    if a.base_step:
        from head_step_cold import base_step

        eagle = first.drafter.head  # the hybrid drafter's EAGLE-3 drafter
        eagle.step = base_step(a.base_step, eagle, first.target.model.model.embed_tokens)
    os.environ.update(dict(kv.split("=", 1) for kv in a.later_env))
    later = a.later_tree or tree
    specs = [first] + [eyas.load(dtype=a.dtype, drafter="hybrid", head=h, tree=later) for h in a.heads[1:]]
    print(f"tree {tree}" + (f", later heads {later}" if later != tree else ""))
    for s in specs:  # warm-up: kernels built, caches sized
        s.generate(qs[0], max_new_tokens=16)
    first.generate(qs[0], max_new_tokens=16, speculate=False)
    arms = [Arm(h) for h in a.heads]
    plain_specs = specs if a.plain_each else [first]  # plain decoding on each arm's target, or the first's
    plains = [Arm(f"plain ({h})" if a.plain_each else "plain") for h in a.heads[: len(plain_specs)]]
    for i, q in enumerate(qs):
        for j in range(len(specs)):
            k = (i + j) % len(specs)
            arms[k].add(specs[k].generate(q, max_new_tokens=a.max_new_tokens))
        for plain, s in zip(plains, plain_specs, strict=True):
            plain.add(s.generate(q, max_new_tokens=a.max_new_tokens, speculate=False))
    if a.plain_each:
        for arm, plain in zip(arms, plains, strict=True):
            print(f"{arm.name}: speculative / plain on its own target x{arm.tok_s / plain.tok_s:.3f}")
    for arm in [*arms, *plains]:
        print(f"{arm.name:48s} decode {arm.tok_s:6.1f} tok/s  tau {arm.tau:.3f}  {arm.ms_a_step:6.2f} ms a step  "
              f"x{arm.tok_s / arms[0].tok_s:.3f} of the first head")


if __name__ == "__main__":
    main()
