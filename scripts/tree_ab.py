"""The tree eyas sizes at load against fixed trees, in one process, question by question (plain decoding beside them).

One target is loaded once; the default drafter runs with the sized tree and with each ``--tree`` given, every question
decoded by each arm in a rotating order, then plainly, so a host that slows down during the run slows every arm
alike. Prints decode tok/s (prefill excluded), tau (pooled over steps) and each arm's speed over plain decoding.
Tuning questions only, never evaluation sets.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/tree_ab.py --questions /tmp/tune.jsonl --limit 12 --dtype float32 \
    dynamic:1,1,1 dynamic:1,2,2 dynamic:2,2,3 dynamic:2,3,4
"""

from __future__ import annotations

import argparse

from head_ab import Arm

import eyas
from eyas.api import Speculator
from eyas.bench.speed import read_questions
from eyas.drafters.loading import DrafterSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("trees", nargs="+", help="fixed trees to compare with the sized one (--tree's syntax)")
    a = ap.parse_args()
    questions = [q["turns"][0] for q in read_questions(a.questions, a.limit)]
    sized = eyas.load(dtype=a.dtype)
    arms = {f"sized: {sized.drafter_spec.tree}": sized}
    arms.update({tree: Speculator(sized.target, DrafterSpec("default", tree=tree)) for tree in a.trees})
    for spec in arms.values():
        spec.generate(questions[0], max_new_tokens=8)  # warm-up
    names = list(arms)
    sums = {name: Arm(name) for name in [*names, "plain"]}  # decode time, tokens, steps, accepted (head_ab.py's)
    for i, q in enumerate(questions):
        for name in [*names[i % len(names):], *names[: i % len(names)], "plain"]:
            spec = sized if name == "plain" else arms[name]
            sums[name].add(spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=name != "plain"))
    plain = sums["plain"].tok_s
    for arm in sums.values():
        print(f"{arm.name:60s} {arm.tok_s:6.1f} tok/s  tau {arm.tau:.3f}  x{arm.tok_s / plain:.3f} of plain")


if __name__ == "__main__":
    main()
