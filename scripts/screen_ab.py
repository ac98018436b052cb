"""Greedy decoding with and without the screened output projection (eyas.models.lm_screen), in one process.

Every question is decoded four ways in a rotating order: plain and speculative (the default drafter, its tree sized
at load), each with the screen and with every logit computed, so a host that slows down slows every arm alike.
Prints decode tok/s (prefill excluded), tau, ms a step, and the speculative/plain ratio within each setting; checks
that all four outputs are the same tokens. Tuning questions only, never evaluation sets.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/screen_ab.py --questions /tmp/tune.jsonl --limit 12
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from head_ab import Arm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()

    import eyas
    from eyas.models import native

    spec = eyas.load(dtype=a.dtype)
    real = native.screened_logits
    settings = {"screened": real, "full": lambda proj, x: None}
    arms = {(s, m): Arm(f"{m} {s}") for s in settings for m in ("plain", "spec")}
    prompts = [json.loads(line)["turns"][0] for line in Path(a.questions).read_text().splitlines()[: a.limit]]
    order = list(arms)
    for i, prompt in enumerate(prompts):
        outs = []
        for s, m in order[i % 4:] + order[: i % 4]:
            native.screened_logits = settings[s]
            r = spec.generate(prompt, max_new_tokens=a.max_new_tokens, speculate=m == "spec")
            arms[s, m].add(r)
            outs.append(r.token_ids)
        native.screened_logits = real
        if any(o != outs[0] for o in outs):
            raise SystemExit(f"question {i}: outputs differ between arms")
    for arm in arms.values():
        print(f"{arm.name:16s} {arm.tok_s:7.1f} tok/s  tau {arm.tau:.3f}  {arm.ms_a_step:6.2f} ms a step")
    for s in settings:
        print(f"{s}: speculative / plain {arms[s, 'spec'].tok_s / arms[s, 'plain'].tok_s:.3f}x")
    for m in ("plain", "spec"):
        print(f"{m}: screened / full {arms['screened', m].tok_s / arms['full', m].tok_s:.3f}x")
    print(f"{len(prompts)} questions, all four outputs identical on each")


if __name__ == "__main__":
    main()
