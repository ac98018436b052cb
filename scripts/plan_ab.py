"""A/B of the decode plan's Python (eyas/models/decode_plan.py): a git revision's ``DecodePlan`` against the
working tree's (each built by its own code), plain decoding of tuning questions in one process, the two alternating
question by question (the order flipped in the second round). Prints decode tok/s of each and whether every output
is the same.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/plan_ab.py --rev ec3d038~1 --questions /tmp/tune.jsonl --limit 8
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import eyas
from eyas.bench.speed import read_questions


def plan_at(rev: str, into: Path):
    """decode_plan.py as it was at ``rev``, imported under its own name."""
    src = subprocess.run(["git", "show", f"{rev}:eyas/models/decode_plan.py"], capture_output=True, text=True,
                         check=True).stdout
    path = into / "decode_plan_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decode_plan_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    qs = [q["turns"][0] for q in read_questions(a.questions, a.limit)]
    with tempfile.TemporaryDirectory() as tmp:
        old = plan_at(a.rev, Path(tmp))
    spec = eyas.load(dtype=a.dtype, drafter="none")
    model = spec.target.model
    # each side's plan built by its own code, so the revision's run() reads the fields its build() made
    plans = {a.rev: old.DecodePlan.build(model), "working tree": model.decode_plan()}
    if any(p is None for p in plans.values()):
        raise SystemExit("no decode plan on this machine (it needs the block kernel for the dtype: EYAS_DECODE_PLAN?)")
    spec.generate(qs[0], max_new_tokens=16, speculate=False)
    secs, toks, ids = dict.fromkeys(plans, 0.0), dict.fromkeys(plans, 0), {}
    try:
        for order in (list(plans), list(plans)[::-1]):
            for q in qs:
                for name in order:
                    model.__dict__["_decode_plan"] = plans[name]
                    r = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False)
                    secs[name] += r.seconds - r.prefill_seconds
                    toks[name] += r.new_tokens - 1
                    ids.setdefault(q, {})[name] = r.token_ids
    finally:
        model.__dict__["_decode_plan"] = plans["working tree"]
    rate = {k: toks[k] / secs[k] for k in plans}
    same = all(len({tuple(v) for v in per.values()}) == 1 for per in ids.values())
    base, new = rate[a.rev], rate["working tree"]
    print(f"plain decode tok/s: {a.rev} {base:.1f}, working tree {new:.1f}: {new / base:.3f}x; identical: {same}")


if __name__ == "__main__":
    main()
