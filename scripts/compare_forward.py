"""Time the native forward of two checkouts in one run (old vs new hot path).

python scripts/compare_forward.py CHECKOUT [THREADS]   # run once per checkout, alternating

Loads the embedded model in bf16 from CHECKOUT's eyas package, caches a 256-token prefix, then times
20 forwards over T = 1, 5 and 9 new tokens (chain mask) after 3 warm-ups; prints CPU and wall ms.
Used for docs/benchmarks.md ("Hot path"): git worktree add /tmp/old 91d40ee, then
for r in /tmp/old . /tmp/old .; do python scripts/compare_forward.py $r 2; done
"""

import sys
import time

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from eyas.models.base import causal_mask  # noqa: E402
from eyas.models.loading import load_target  # noqa: E402

m = load_target(None, "bfloat16").model
prefix = 256
cache = m.new_cache(1, 600)
ids = torch.randint(0, m.config.vocab_size, (1, prefix))
m.forward(ids, torch.arange(prefix)[None], cache, 0)
res = []
for t in (1, 5, 9):
    tok = torch.randint(0, 1000, (1, t))
    pos = torch.arange(prefix, prefix + t)[None]
    mask = causal_mask(t, prefix, device=tok.device)[None]
    for _ in range(3):
        m.forward(tok, pos, cache, prefix, mask=mask)
    n = 20
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        m.forward(tok, pos, cache, prefix, mask=mask)
    cpu, wall = (time.process_time() - c0) / n, (time.perf_counter() - w0) / n
    res.append(f"T={t}: cpu {1000 * cpu:.1f} wall {1000 * wall:.1f}")
print(sys.argv[1], " | ".join(res))
