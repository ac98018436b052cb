"""Write a tuning question set (EAGLE question.jsonl format) from MT-Bench-101 first turns.

Trees and other inference settings are tuned on these, never on the evaluation sets
(MT-bench, HumanEval, GSM8K, Alpaca eval). MT-Bench-101 is training-distribution data; the shipped
(commercial) head's data holds every MT-Bench-101 dialogue, so these questions' answers were trained on.
That costs little as a yardstick: the head scores the same teacher-forced top-1 on Magpie files it was
trained on (2.5 passes) as on unseen ones (scripts/head_fit.py, docs/benchmarks.md), but measure
held-aside figures on conversations a head never saw.

python scripts/tune_questions.py --out /tmp/tune.jsonl [--count 24] [--data-dir ../shared/data/train]
python scripts/tune_questions.py --out /tmp/val.jsonl --count 48 --offset 14 --exclude /tmp/tune.jsonl  # held out
python scripts/tune_questions.py --out /tmp/cpu21.jsonl --count 48 \
    --from-data data/selfdistill/smollm2-135m-instruct-magpie-cpu21.jsonl.xz   # requests no shipped head trained on
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path


def from_data(path: str, count: int) -> list[dict]:
    """The first ``count`` first user turns (20 characters or more) of a self-distilled ``eyas data`` file."""
    out = []
    with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            if msgs[0]["role"] == "user" and len(msgs[0]["content"]) >= 20:
                out.append({"question_id": len(out), "category": "self-distilled", "turns": [msgs[0]["content"]]})
            if len(out) == count:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data/train"))
    ap.add_argument("--offset", type=int, default=0, help="first record taken (another set: half the stride)")
    ap.add_argument("--exclude", default=None, help="a question file whose ids are left out (e.g. the first set)")
    ap.add_argument("--from-data", default=None, metavar="FILE",
                    help="take the first user turns of this `eyas data` file (.jsonl or .jsonl.xz) instead")
    a = ap.parse_args()
    if a.from_data:
        qs = from_data(a.from_data, a.count)
        with open(a.out, "w") as f:
            f.writelines(json.dumps(q) + "\n" for q in qs)
        print(f"wrote {len(qs)} questions to {a.out}")
        return
    records = [json.loads(line) for line in open(Path(a.data_dir) / "mt_bench_101/mtbench101.jsonl")]
    stride = max(1, len(records) // a.count)
    skip = {json.loads(line)["question_id"] for line in open(a.exclude)} if a.exclude else set()
    # spread over all task kinds (the file is grouped by task)
    picked = [r for r in records[a.offset :: stride] if r["id"] not in skip][: a.count]
    with open(a.out, "w") as f:
        for r in picked:
            turn = r["history"][0]["user"]
            f.write(json.dumps({"question_id": r["id"], "category": r["task"], "turns": [turn]}) + "\n")
    print(f"wrote {len(picked)} questions to {a.out}")


if __name__ == "__main__":
    main()
