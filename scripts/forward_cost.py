"""Time one target forward over T new tokens after a 256-token prefix, and one EAGLE-3 head
level over F tree nodes: what a speculative step costs against plain decoding on this machine.

python scripts/forward_cost.py [--head DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.models.base import causal_mask
from eyas.models.loading import load_target


def time_target(model, widths, prefix: int = 256, reps: int = 5) -> dict[int, float]:
    out = {}
    cache = model.new_cache(1, prefix + max(widths) + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, prefix))
    model.forward(ids, torch.arange(prefix)[None], cache, 0)
    for t in widths:
        tok = torch.randint(0, model.config.vocab_size, (1, t))
        pos = torch.arange(prefix, prefix + t)[None]
        mask = causal_mask(t, prefix, device=tok.device)[None]
        model.forward(tok, pos, cache, prefix, mask=mask)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            model.forward(tok, pos, cache, prefix, mask=mask)
        out[t] = 1000 * (time.perf_counter() - t0) / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,2,4,8,16,33")
    ap.add_argument("--head", default=None, help="EAGLE-3 head dir: also time one draft level")
    a = ap.parse_args()
    widths = [int(x) for x in a.widths.split(",")]
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    for dtype in ("float32", "bfloat16"):
        m = load_target(None, dtype).model
        ms = time_target(m, widths)
        print(f"target {dtype:9s} " + "  ".join(f"T={t}: {v:6.1f} ms" for t, v in ms.items()))
        if a.head:
            from eyas.drafters.eagle3 import Eagle3Drafter

            d = Eagle3Drafter(target_model=m, path=a.head, tree="dynamic:8,6,32")
            hc = d.head.config
            from eyas.kv.static import KVCache

            for f in (1, 8):
                cache = KVCache.empty(1, 1, hc.num_kv_heads, 512, hc.head_dim, d.head_dtype)
                emb = torch.randn(1, f, hc.hidden_size, dtype=d.head_dtype)
                pos = torch.full((1, f), 300)
                mask = torch.ones(1, f, 300 + f, dtype=torch.bool)
                def run(d=d, emb=emb, pos=pos, cache=cache, mask=mask):
                    return d._logp(d.head(emb, emb, pos, cache, 300, mask))
                run()
                t0 = time.perf_counter()
                for _ in range(5):
                    run()
                print(f"  head level ({d.head_dtype}, {f} nodes): {1000 * (time.perf_counter() - t0) / 5:.1f} ms")


if __name__ == "__main__":
    main()
