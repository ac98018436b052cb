"""What a small torch call costs right after a forward's weight stream, against the same call in a hot loop.

A decoding step runs the target's kernels (~100 MB of weights through the caches), then dozens of small calls:
verification, the draft head's layer, its top-k, the tree's books. Each of those calls' code and data may have left
the caches by then. This times a few typical ones, each first after the target's block projections (one forward's
worth, 1 row), after a 100 MB torch ``add_``, after a 5 ms sleep, and in a hot loop (medians of ``--passes``).

python scripts/cold_ops.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import eyas
from eyas.models.decode_plan import DecodePlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=40)
    a = ap.parse_args()
    spec = eyas.load(dtype="bfloat16")
    model = spec.target.model
    plan = DecodePlan.build(model)
    if plan is None:
        raise SystemExit("no decode plan here: needs the embedded GGUF target in bf16 on a CPU with AVX512-BF16")
    d, i = model.config.hidden_size, model.config.intermediate_size
    projs = [(p, k) for layer in plan.layers for p, k in ((layer.qkv, d), (layer.o, d), (layer.gate_up, d),
                                                          (layer.down, i))]
    xs = [torch.randn(1, k).bfloat16() for _, k in projs]
    head = spec.drafter.head
    tokens = torch.tensor([5, 77])
    logits = torch.randn(1, 8192)
    calls = {
        "torch.arange(3, 6)": lambda: torch.arange(3, 6),
        "torch.tensor([1, 2, 3])": lambda: torch.tensor([1, 2, 3]),
        "topk(2) of 8,192": lambda: logits.topk(2, dim=-1),
        "the head's embedding, 2 tokens": lambda: head._embed(tokens),
        "torch.arange again": lambda: torch.arange(3, 6),
        "log_softmax of 8,192": lambda: torch.log_softmax(logits, -1),
        "8,192 + 1": lambda: logits + 1,
    }
    big = torch.zeros(25_000_000)

    def forward() -> None:
        for (p, _), x in zip(projs, xs, strict=True):
            plan.blocks.linear(x, p.data, p.code, p.bias)

    preludes = {"after the projections": forward, "after a 100 MB add_": lambda: big.add_(1.0),
                "after sleep(5 ms)": lambda: time.sleep(0.005), "hot loop": lambda: None}
    out = {}
    with torch.inference_mode():
        for name, prelude in preludes.items():
            times = {c: [] for c in calls}
            for _ in range(a.passes):
                prelude()
                for c, fn in calls.items():  # in order: each call's first time since the prelude
                    t0 = time.perf_counter()
                    fn()
                    times[c].append(time.perf_counter() - t0)
            out[name] = {c: 1e6 * statistics.median(v) for c, v in times.items()}
    print(f"us a call (median of {a.passes}): " + " | ".join(preludes))
    for c in calls:
        print(f"  {c:32s} " + " | ".join(f"{out[p][c]:7.1f}" for p in preludes))


if __name__ == "__main__":
    main()
