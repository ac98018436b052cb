"""Greedy decoding with and without the screened output projection (eyas.models.lm_screen), in one process.

Every question is decoded four ways in a rotating order: plain and speculative (the default drafter, its tree sized
at load), each with the screen and with every logit computed, so a host that slows down slows every arm alike.
Prints decode tok/s (prefill excluded), tau, ms a step, and the speculative/plain ratio within each setting; checks
that all four outputs are the same tokens. Tuning questions only, never evaluation sets.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/screen_ab.py --questions /tmp/tune.jsonl --limit 12
python scripts/screen_ab.py --questions /tmp/tune.jsonl --limit 6 --projection   # the projection alone, by rows

``--projection`` takes the target's final hidden rows along the questions' greedy answers and times the output
projection alone, full against screened (best of 3 passes of 50), at 1-8 rows; it also counts the candidates the
screen computes exactly and checks every argmax against the full logits'.
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
    ap.add_argument("--projection", action="store_true", help="time the output projection alone, by rows")
    a = ap.parse_args()
    if a.projection:
        return projection(a)

    import eyas
    from eyas.models import native

    spec = eyas.load(dtype=a.dtype)
    real = native.screened
    settings = {"screened": real, "full": lambda proj, x: None}
    arms = {(s, m): Arm(f"{m} {s}") for s in settings for m in ("plain", "spec")}
    prompts = [json.loads(line)["turns"][0] for line in Path(a.questions).read_text().splitlines()[: a.limit]]
    order = list(arms)
    for i, prompt in enumerate(prompts):
        outs = []
        for s, m in order[i % 4:] + order[: i % 4]:
            native.screened = settings[s]
            r = spec.generate(prompt, max_new_tokens=a.max_new_tokens, speculate=m == "spec")
            arms[s, m].add(r)
            outs.append(r.token_ids)
        native.screened = real
        if any(o != outs[0] for o in outs):
            raise SystemExit(f"question {i}: outputs differ between arms")
    for arm in arms.values():
        print(f"{arm.name:16s} {arm.tok_s:7.1f} tok/s  tau {arm.tau:.3f}  {arm.ms_a_step:6.2f} ms a step")
    for s in settings:
        print(f"{s}: speculative / plain {arms[s, 'spec'].tok_s / arms[s, 'plain'].tok_s:.3f}x")
    for m in ("plain", "spec"):
        print(f"{m}: screened / full {arms['screened', m].tok_s / arms['full', m].tok_s:.3f}x")
    print(f"{len(prompts)} questions, all four outputs identical on each")


def projection(a) -> None:
    import time

    import torch

    import eyas
    from eyas import kernels
    from eyas.models.exact import DecodeFloors, linear
    from eyas.models.lm_screen import screened_logits

    spec = eyas.load(dtype=a.dtype, drafter="none")
    m = spec.target.model
    hidden = []
    for line in Path(a.questions).read_text().splitlines()[: a.limit]:
        prompt = json.loads(line)["turns"][0]
        out = spec.generate(prompt, max_new_tokens=a.max_new_tokens, speculate=False)
        ids = torch.cat([spec.encode(prompt), torch.tensor(out.token_ids)])[None]
        with torch.inference_mode():
            hidden.append(m.forward(ids, torch.arange(ids.shape[1])[None], m.new_cache(1, ids.shape[1]), 0).hidden[0])
    x = torch.cat(hidden).to(m.dtype)  # [N, H] final-norm rows of prompts and answers
    floors = DecodeFloors(m.row_floors)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(50):
                fn()
            times.append((time.perf_counter() - t) / 50)
        return 1e3 * min(times)

    with torch.inference_mode():
        kept, wrong = [], 0
        for i in range(0, x.shape[0] - 4, 5):
            rows = x[i : i + 5][None]
            got = screened_logits(m.lm_head_proj, rows)[0]
            full = linear(m.lm_head_proj, rows, floors)[0].float()
            wrong += int((kernels.argmax(got) != kernels.argmax(full)).sum())
            kept.append(int(torch.isfinite(got[0]).sum()))
        print(f"{x.shape[0]} rows; candidates computed exactly per 5-row call: mean {sum(kept) / len(kept):.1f}, "
              f"max {max(kept)}; argmax differing from the full logits': {wrong}")
        for r in (1, 2, 3, 4, 6, 8):
            rows = x[100 : 100 + r][None]
            full_ms = best(lambda rows=rows: linear(m.lm_head_proj, rows, floors).float())
            screened_ms = best(lambda rows=rows: screened_logits(m.lm_head_proj, rows))
            print(f"{r} rows: full {full_ms:.3f} ms, screened {screened_ms:.3f} ms ({screened_ms / full_ms:.2f}x)")


if __name__ == "__main__":
    main()
