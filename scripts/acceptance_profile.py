"""Measure an EAGLE-3 head's acceptance by depth and rank, teacher-forced, for tree sizing (eyas.tree.sizing).

The target answers the tuning questions greedily; then, at every answer position t, the head drafts
along the target's own continuation (training-time-test unroll, eyas.train.eagle3: step k reads the
true token and the head's previous output, exactly what the drafter does at depth k + 1 of a tree
whose path so far is correct). rank_accept[d][r] = P(the target's token at depth d + 1 is the head's
rank-r proposal | the ranks above were all < R). Then the drafter itself (bf16 kernels and all) is replayed
over the same texts for every EAGLE-2 tree shape (eyas.tree_replay): ``tree_tau``, the tokens per step each
(top_k, depth, total) yields, which the sizer uses in place of the rank model. Writes HEAD/profile.json,
which eyas.autotree reads.
Tune on the training distribution only (scripts/tune_questions.py), never on evaluation prompts.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/acceptance_profile.py --head eyas/heads/smollm2-135m-instruct-eagle3 --questions /tmp/tune.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eyas.train.profile import write_profile


def replay_trees(target, head_dir: Path, texts, top_ks, depth: int, max_total: int) -> dict:
    """τ of every (top_k, depth, total) tree: the real drafter replayed over the texts (eyas.tree_replay)."""
    from tqdm import tqdm

    from eyas.drafters.eagle3 import Eagle3Drafter
    from eyas.tree_replay import ReplayConfig, replay_text, replay_tree, text_features, tree_taus

    cfg = ReplayConfig(top_ks=top_ks, max_depth=depth, max_total=max_total)
    drafters = {k: Eagle3Drafter(target_model=target, path=head_dir, tree=replay_tree(k, cfg)) for k in cfg.top_ks}
    tables = {k: [] for k in cfg.top_ks}
    for ids, p in tqdm(texts, desc="replaying trees"):
        feats = text_features(target, ids, drafters[cfg.top_ks[0]].taps)  # one target forward per text
        for k, drafter in drafters.items():
            tables[k].append(replay_text(drafter, ids, p, feats, cfg))
    return tree_taus(tables, cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True)
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="default: HEAD/profile.json")
    ap.add_argument("--top-ks", default="1,2,3,4,6,8", help="top-k values whose trees are replayed")
    ap.add_argument("--max-total", type=int, default=63, help="largest tree replayed (draft tokens)")
    a = ap.parse_args()
    import eyas
    from eyas.formats.eagle3 import load_eagle3

    spec = eyas.load(drafter="none", dtype=a.dtype)
    target = spec.target.model
    head = load_eagle3(Path(a.head), target.config, target.dtype).float()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    texts = []
    for q in qs:
        prompt = spec.encode(q)
        answer = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False).token_ids
        ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
        texts.append((ids, prompt.shape[0]))
    tree_tau = replay_trees(target, Path(a.head), texts, tuple(int(k) for k in a.top_ks.split(",")), a.depths,
                            a.max_total)
    measured_on = f"{len(qs)} questions of {a.questions}, {a.max_new_tokens} greedy tokens, target {a.dtype}"
    command = ("python scripts/acceptance_profile.py --head HEAD --questions tune.jsonl "
               f"--limit {a.limit} --max-new-tokens {a.max_new_tokens} --dtype {a.dtype} --top-ks {a.top_ks} "
               f"--max-total {a.max_total}")
    # the answer starts after the prompt: the profile's ``first`` is the prompt's last position
    out = write_profile(Path(a.head), target, head, [(ids, p - 1) for ids, p in texts], measured_on, a.depths,
                        a.ranks, out=a.out, extra={
                            "tree_tau": {f"{k},{d},{t}": round(v, 4) for (k, d, t), v in tree_tau.items()},
                            "command": command})
    print(out.read_text())


if __name__ == "__main__":
    main()
