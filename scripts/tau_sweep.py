"""Acceptance (tau) of several drafters / trees on one question set: speculative generations only, no timing.

tau = 1 + accepted / steps over all questions (vLLM's definition), deterministic for greedy decoding,
so it can be measured on a busy machine. Tune on the training distribution only
(scripts/tune_questions.py), never on the evaluation sets.

python scripts/tau_sweep.py --questions /tmp/tune.jsonl --limit 12 --dtype bfloat16 \
    --run "default|dynamic:4,3,4" --run "ngram||num_draft=4" --run "hybrid|dynamic:4,3,4"

Each --run is DRAFTER|TREE[|key=value;...] (drafter options as JSON values, e.g. budget=8;lookup_accept=[0.3,0.5]).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def parse_run(s: str) -> tuple[str, str | None, dict]:
    name, _, rest = s.partition("|")
    tree, _, opts = rest.partition("|")
    options = {}
    for kv in filter(None, opts.split(";")):
        k, _, v = kv.partition("=")
        val = json.loads(v)
        options[k] = tuple(val) if isinstance(val, list) else val
    return name, tree or None, options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--run", action="append", required=True)
    ap.add_argument("--json", default=None, help="append one JSON line per run to this file")
    ap.add_argument("--check-identity", action="store_true",
                    help="also decode plainly (same numerics mode) and count outputs identical to it")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import eyas
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    target = None
    for run in a.run:
        name, tree, options = parse_run(run)
        if target is None:
            target = eyas.load(drafter="none", dtype=a.dtype).target
        spec = Speculator(target, DrafterSpec(name, tree=tree, options=options))
        steps = acc = same = 0
        per_pos: list[int] = []
        t0 = time.perf_counter()
        for q in qs:
            out = spec.generate(q, max_new_tokens=a.max_new_tokens)
            if a.check_identity:
                same += spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False).token_ids == out.token_ids
            steps, acc = steps + out.steps, acc + out.accepted
            new = out.accepted_per_pos
            width = max(len(per_pos), len(new))
            per_pos = [a + b for a, b in zip(per_pos + [0] * (width - len(per_pos)), new + [0] * (width - len(new)),
                                             strict=True)]
        nodes = spec.drafter.max_nodes if spec.drafter is not None else 1
        rec = {"run": run, "nodes": nodes, "tau": round(1 + acc / max(steps, 1), 4), "steps": steps,
               "accepted": acc, "accepted_per_pos": per_pos, "questions": len(qs), "dtype": a.dtype,
               "max_new_tokens": a.max_new_tokens, "seconds": round(time.perf_counter() - t0, 1)}
        if a.check_identity:
            rec["identical"] = f"{same}/{len(qs)}"
        print(json.dumps(rec), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
