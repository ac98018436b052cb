"""Is the draft head's cost memory traffic? Its drafting time with its weights as decoding leaves them (the target's
~90 MB weight stream between two drafts evicts them) against the same with its weights read into the caches right
before each call (that read not timed), alternating question by question in one process, tuning questions only.

If warm calls are much cheaper, prefetching the head's weights (during the verify forward) would pay; if not, the
head's time is its kernels' compute and per-call overhead.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/head_cache_ab.py --questions /tmp/tune.jsonl --limit 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import eyas
from eyas.drafters.head_kernels import fused_parts
from eyas.drafters.hybrid import HybridDrafter
from eyas.models.gguf_blocks import attached_blocks


def head_blocks(head: torch.nn.Module) -> list[torch.Tensor]:
    """The GGUF blocks (or int8 rows) the head's projections read while drafting: a fused matrix in place of the
    projections it joins (eyas.drafters.head_kernels.fuse_head_blocks_), every other projection's own.
    """
    out, fused_away = [], set()
    for mod in head.modules():
        if "_eyas_fused" in mod.__dict__:
            out.append(mod.__dict__["_eyas_fused"].data)
            fused_away.update(id(p) for p in fused_parts(mod))
    out += [b.data for m in head.modules() if (b := attached_blocks(m)) is not None and id(m) not in fused_away]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    spec = eyas.load(dtype=a.dtype)
    if not isinstance(spec.drafter, HybridDrafter):
        raise SystemExit(f"expected the default hybrid drafter, got {type(spec.drafter).__name__}")
    blocks = head_blocks(spec.drafter.head.head)
    if not blocks:
        raise SystemExit("the head has no GGUF blocks here (EYAS_HEAD_Q8=0, or not a CPU with AVX512-BF16)")
    print(f"head blocks: {len(blocks)} tensors, {sum(b.numel() for b in blocks) / 1e6:.2f} MB")
    warm = [False]
    calls: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, int] = {False: 0, True: 0}
    for name in ("extend", "propose"):
        real = getattr(HybridDrafter, name)

        def timed(self, *args, _real=real, **kw):
            if warm[0]:
                for b in blocks:
                    b.max()  # reads every byte: the blocks now sit in L2/L3
            t0 = time.perf_counter()
            out = _real(self, *args, **kw)
            calls[warm[0]].append(time.perf_counter() - t0)
            return out

        setattr(HybridDrafter, name, timed)
    spec.generate(qs[0], max_new_tokens=16)
    for _ in range(a.rounds):
        for q in qs:
            for w in (False, True):
                warm[0] = w
                steps[w] += spec.generate(q, max_new_tokens=a.max_new_tokens).steps
    for w in (False, True):
        v = calls[w]
        print(f"{'warm' if w else 'cold'}: {1e3 * sum(v) / steps[w]:.3f} ms a step drafting (extend + propose), "
              f"median call {1e3 * statistics.median(v):.3f} ms, {len(v)} calls, {steps[w]} steps")


if __name__ == "__main__":
    main()
