"""The target's layers through their modules against its decode plan (eyas.models.decode_plan), in one process.

Tuning questions (never evaluation sets), plain then speculative decoding, the two ways alternating question by
question, round after round (a slow spell of the shared host touches both); prints ms per generated token
(prompt processing included) and whether every answer is the same both ways.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/decode_plan_ab.py --questions /tmp/tune.jsonl --limit 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time

import eyas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    spec = eyas.load(dtype="bfloat16")
    model = spec.target.model
    plan = model.decode_plan()
    if plan is None:
        raise SystemExit("no decode plan here: needs the embedded GGUF target in bf16 with the compiled kernels")
    ways = {"modules": None, "plan": plan}
    spec.generate(qs[0], max_new_tokens=16)
    for speculate in (False, True):
        secs = {w: 0.0 for w in ways}
        tokens = {w: 0 for w in ways}
        texts: dict[str, list[str]] = {w: [] for w in ways}
        for _ in range(a.rounds):
            for q in qs:
                for way, p in ways.items():
                    model.__dict__["_decode_plan"] = p
                    t = time.perf_counter()
                    r = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=speculate)
                    secs[way] += time.perf_counter() - t
                    tokens[way] += r.new_tokens
                    texts[way].append(r.text)
        model.__dict__["_decode_plan"] = plan
        ms = {w: 1e3 * secs[w] / tokens[w] for w in ways}
        label = "speculative" if speculate else "plain"
        print(f"{label:12s} ms a token: modules {ms['modules']:.2f}, plan {ms['plan']:.2f} "
              f"({ms['modules'] / ms['plan']:.3f}x); answers the same: {texts['modules'] == texts['plan']}")


if __name__ == "__main__":
    main()
