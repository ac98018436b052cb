"""Where a decoding step's time goes, plain against speculative, on tuning questions (never evaluation sets).

Wraps SpecDecoder's three verbs (draft, verify_forward, accept) with timers, runs plain decoding then the drafter
over the same questions in one process, and prints ms per step of each, tau, the step ratio and decode tok/s
(prefill excluded). ``--tree`` fixes the tree; without it eyas sizes one at load (eyas.autotree).

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/step_profile.py --questions /tmp/tune.jsonl --limit 12 --tree dynamic:2,1,2
"""

from __future__ import annotations

import argparse
import json
import time

import eyas
from eyas.decode import SpecDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    spec = eyas.load(dtype=a.dtype, tree=a.tree)
    print("tree", spec.drafter_spec.tree, spec.tree_choice)
    times: dict[str, list[float]] = {"draft": [], "verify_forward": [], "accept": []}
    for name in times:
        real = getattr(SpecDecoder, name)

        def timed(self, *args, _real=real, _name=name):
            t0 = time.perf_counter()
            out = _real(self, *args)
            times[_name].append(time.perf_counter() - t0)
            return out

        setattr(SpecDecoder, name, timed)
    spec.generate(qs[0], max_new_tokens=16)
    spec.generate(qs[0], max_new_tokens=16, speculate=False)
    rows = {}
    for speculate in (False, True):
        for v in times.values():
            v.clear()
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
    (pm, ptps, _), (sm, stps, tau) = rows[False], rows[True]
    print(f"tau {tau:.2f}  step/plain {sum(sm.values()) / sum(pm.values()):.2f}  decode tok/s plain {ptps:.1f} "
          f"speculative {stps:.1f}  speedup {stps / ptps:.2f}")


if __name__ == "__main__":
    main()
