"""How much of the target's answers an EAGLE-3 head's draft vocabulary can draft, and heads grown to larger ones.

A target token outside the draft vocabulary is a certain miss at every depth. For the head and each ``--sizes`` N,
prints the share of assistant tokens (the labels, counted as ``eyas train`` counts them) held by the vocabulary, on
the ``--train`` files (where the added ids come from: the head's ids first, then the most frequent others, as
``eyas train --grow-draft-vocab N`` chooses them) and on each ``--eval`` file (never used to choose). With ``--out``,
writes each grown head (``eyas.train.eagle3.grow_draft_vocab``: the head's rows kept, the new ones mapped from the
target's) to OUT/vocabN with the head's eyas.json and profile.json, for scripts/head_fit.py and scripts/head_ab.py.

python scripts/grow_vocab.py --head eyas/heads/smollm2-135m-instruct-eagle3 --sizes 12288,16384,24576 \
    --train data/selfdistill/smollm2-135m-instruct-commercial.jsonl data/selfdistill/*-magpie-{gpu,cpu1[0-8]}*.xz \
    --eval data/selfdistill/smollm2-135m-instruct-magpie-cpu19.jsonl.xz \
    --eval data/heldout/smollm2-135m-instruct-magpie-seed13.jsonl.xz --out /tmp/grown
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.models.loading import load_target
from eyas.train.dataset import _assistant_counts, draft_vocab, load_examples
from eyas.train.eagle3 import grow_draft_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="eyas/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--train", nargs="+", required=True, help="the files the head trains on (ids are chosen here)")
    ap.add_argument("--eval", action="append", default=[], help="a file to measure coverage on (repeatable)")
    ap.add_argument("--sizes", default="12288,16384")
    ap.add_argument("--out", default=None, help="write the grown heads to OUT/vocabN")
    a = ap.parse_args()
    loaded = load_target(None, "float32")
    v = loaded.model.config.vocab_size
    head = load_eagle3(a.head, loaded.model.config, torch.float32)
    old = head.draft_ids()
    train_ex = load_examples(a.train, loaded.tokenizer, log=lambda m: None)
    counts = {"train": _assistant_counts(train_ex, v)}
    for path in a.eval:
        counts[Path(path).name] = _assistant_counts(load_examples([path], loaded.tokenizer, log=lambda m: None), v)
    print("assistant tokens:", ", ".join(f"{k} {int(c.sum()):,}" for k, c in counts.items()))
    vocabs = {len(old): old}
    for n in (int(s) for s in a.sizes.split(",")):
        vocabs[n] = draft_vocab(train_ex, v, n, always=old.tolist())[0]
    for n, ids in vocabs.items():
        shares = ", ".join(f"{k} {float(c[ids].sum() / c.sum()):.4f}" for k, c in counts.items())
        print(f"draft vocabulary {n:6d} ({'the head' if n == len(old) else 'grown'}): {shares}")
        if a.out and n != len(old):
            dst = Path(a.out) / f"vocab{n}"
            grown = grow_draft_vocab(load_eagle3(a.head, loaded.model.config, torch.float32),
                                     loaded.model.lm_head_proj.weight, ids)
            save_eagle3(grown, dst, target_name="embedded:smollm2-135m-instruct")
            for name in ("eyas.json", "profile.json"):
                if (Path(a.head) / name).exists():
                    shutil.copy(Path(a.head) / name, dst / name)
            print(f"  -> {dst}")


if __name__ == "__main__":
    main()
