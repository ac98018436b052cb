"""What the draft head's kernels and the output screen cost inside decoding, against the same calls with their
weights cached: how much of each is the weights' trip from memory (the verify forward streams ~130 MB a step).

Tuning questions (never evaluation sets). Speculative decoding runs with the head's int8 projections and vocabulary
head, and the screen's integer pass, timed at each call; then one call of each kind (weight shape, rows), with
the inputs of the last one seen, repeats until its weights sit in the caches. Prints medians in ms.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/cache_cost.py --questions /tmp/tune.jsonl --limit 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import eyas
from eyas.drafters.eagle3 import Eagle3Drafter
from eyas.models import lm_screen
from eyas.models.int8_rows import Int8Rows


def timed(owner, name: str, label: str, key, times: dict, last: dict) -> None:
    """owner.name timed into times[(label, key(args))]; the latest arguments of each kept in last."""
    real = getattr(owner, name)

    def run(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        k = (label, key(args))
        times[k].append(time.perf_counter() - t0)
        last[k] = (real, args, kw)
        return out

    setattr(owner, name, run)


def cached_ms(call, repeats: int = 200) -> float:
    real, args, kw = call
    for _ in range(5):
        real(*args, **kw)
    t0 = time.perf_counter()
    for _ in range(repeats):
        real(*args, **kw)
    return 1e3 * (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    spec = eyas.load(dtype="bfloat16")
    spec.generate(qs[0], max_new_tokens=16)
    times: dict[tuple, list[float]] = defaultdict(list)
    last: dict = {}
    # by the weight's shape [N, K] and the rows x has; the vocabulary head and the screen by rows
    timed(Int8Rows, "linear", "head int8 projection", lambda a: (tuple(a[0].data.shape), a[1].numel() // a[0].k),
          times, last)
    timed(Eagle3Drafter, "_logp", "head vocabulary + log-softmax", lambda a: a[1].numel() // a[1].shape[-1],
          times, last)
    timed(lm_screen.ArgmaxScreen, "logits", "output screen", lambda a: a[1].shape[0], times, last)
    with torch.inference_mode():
        for q in qs:
            spec.generate(q, max_new_tokens=a.max_new_tokens)
        if not times:
            print("nothing timed: no int8 head and no screen on this machine")
        for k in sorted(times, key=str):
            if len(times[k]) >= 20:
                print(f"{k[0]:30s} {str(k[1]):18s} in decoding {1e3 * statistics.median(times[k]):.3f} ms "
                      f"({len(times[k])} calls), cached {cached_ms(last[k]):.3f} ms")

if __name__ == "__main__":
    main()
