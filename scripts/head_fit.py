"""Does the draft head fit its training data better than unseen data of the same kind? (teacher-forced top-1)

For each data file (optionally one ``source`` of it), the first turns of the first ``--limit`` conversations with at
least ``--min-tokens`` answer tokens are run through the target once, and the head drafts along the stored answer as in
scripts/acceptance_profile.py (``ranks_along``: step k reads the true tokens and the head's own previous output).
Printed per file: the rate at which the head's top-1 is the answer's next token at depth 1, and at depths 2 and 3
given the depths above were right. Files the head was trained on against files it never saw (same generator, same
prompt source) tell whether more data of that kind can still help: a head that fits its training files better than
unseen ones is data-limited; one that scores the same on both is limited by its capacity or its training schedule.

python scripts/head_fit.py --head eyas/heads/smollm2-135m-instruct-eagle3 \
    --data data/selfdistill/smollm2-135m-instruct-magpie-gpu.jsonl.xz \
    --data data/selfdistill/smollm2-135m-instruct-magpie-cpu11.jsonl.xz \
    --data data/selfdistill/smollm2-135m-instruct-commercial.jsonl:mt_bench_101 --limit 60
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

import torch

from eyas.train.profile import depth_counts, ranks_along


def conversations(spec_path: str, min_tokens: int):
    """Yield (user text, answer text): the first turn of each record of ``FILE[:SOURCE]``."""
    path, _, source = spec_path.partition(":")
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            msgs = r["messages"]
            if source and r.get("source") != source:
                continue
            if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
                continue
            if len(msgs) == 2 and r.get("usage", {}).get("completion_tokens", min_tokens) < min_tokens:
                continue  # (multi-turn records: the first answer's length is checked below)
            yield msgs[0]["content"], msgs[1]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="eyas/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--data", action="append", required=True, help="FILE or FILE:SOURCE (repeatable)")
    ap.add_argument("--limit", type=int, default=60, help="conversations per file")
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-answer", type=int, default=256, help="answer tokens scored per conversation")
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    import eyas
    from eyas.formats.eagle3 import load_eagle3

    spec = eyas.load(drafter="none", dtype=a.dtype)
    target = spec.target.model
    head = load_eagle3(Path(a.head), target.config, target.dtype).float()
    tok = spec.tokenizer
    for data in a.data:
        hits, seen, convs = torch.zeros(a.depths), torch.zeros(a.depths), 0
        for user, answer in conversations(data, a.min_tokens):
            if convs == a.limit:
                break
            prompt = spec.encode(user)
            ans = tok(answer, add_special_tokens=False)["input_ids"][: a.max_answer]
            if len(ans) < a.min_tokens:
                continue
            ids = torch.cat([prompt, torch.tensor(ans, dtype=torch.long)])
            n_seen, n_hits = depth_counts(ranks_along(target, head, ids, a.depths), prompt.shape[0] - 1, 1)
            seen, hits = seen + n_seen, hits + n_hits[:, 0]
            convs += 1
        rates = " / ".join(f"{float(h / max(s, 1)):.3f}" for h, s in zip(hits, seen, strict=True))
        print(f"{data}: {convs} conversations, {int(seen[0])} positions, top-1 at depth 1..{a.depths}: {rates}",
              flush=True)


if __name__ == "__main__":
    main()
