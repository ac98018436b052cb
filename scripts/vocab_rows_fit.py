"""Train only the rows a grown draft vocabulary added (scripts/grow_vocab.py), on the CPU: does training lift them?

The head's other weights and its earlier rows stay frozen (their logits cannot change); the new rows learn the
target's soft labels at depth 1 (``eyas train``'s EAGLE-3 loss with one TTT step) on the first ``--limit``
conversations of the training files, the target's features computed once and kept. Writes the head to ``--out``
for scripts/head_fit.py. A measurement for the next GPU draw's choice, not a way to make shipped heads.

python scripts/vocab_rows_fit.py --head /tmp/grown/vocab12288 --base eyas/heads/smollm2-135m-instruct-eagle3 \
    --data data/selfdistill/smollm2-135m-instruct-magpie-cpu18.jsonl.xz --limit 300 --out /tmp/grown/vocab12288-fit
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.models.loading import load_target
from eyas.train.dataset import collate, load_examples, token_batches
from eyas.train.eagle3 import Eagle3LossConfig, Eagle3Objective
from eyas.train.features import TargetFeaturizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", required=True, help="the grown head")
    ap.add_argument("--base", required=True, help="the head it was grown from (its ids stay frozen)")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_target(None, "bfloat16")
    cfg = loaded.model.config
    head = load_eagle3(a.head, cfg, torch.float32).requires_grad_(False)
    kept = torch.isin(head.draft_ids(), load_eagle3(a.base, cfg, torch.float32).draft_ids())  # [Vd] frozen rows
    head.lm_head.weight.requires_grad_(True)
    head.lm_head.weight.register_hook(lambda g: g.masked_fill(kept[:, None], 0.0))
    examples = load_examples(a.data, loaded.tokenizer, 1024, log=lambda m: None)[: a.limit]
    feat = TargetFeaturizer(loaded.model, head.cfg.aux_layers)
    t0 = time.time()
    batches = []
    for idx in token_batches(examples, 8192, 0):
        b = collate([examples[i] for i in idx])
        batches.append(feat(b["input_ids"], b["attention_mask"], b["loss_mask"]))
    print(f"features of {len(examples)} conversations, {len(batches)} batches in {time.time() - t0:.0f} s")
    obj = Eagle3Objective(head, loaded.model, Eagle3LossConfig(ttt_steps=1))
    opt = torch.optim.Adam([head.lm_head.weight], lr=a.lr)
    for epoch in range(a.epochs):
        total = 0.0
        for fb in batches:
            loss, _ = obj.loss(fb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        print(f"epoch {epoch}: loss {total / len(batches):.4f} ({time.time() - t0:.0f} s)")
    save_eagle3(head.requires_grad_(False), a.out, target_name="embedded:smollm2-135m-instruct")
    for name in ("eyas.json", "profile.json"):
        if (Path(a.head) / name).exists():
            shutil.copy(Path(a.head) / name, Path(a.out) / name)


if __name__ == "__main__":
    main()
