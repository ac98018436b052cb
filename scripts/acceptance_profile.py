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


@torch.inference_mode()
def ranks_along(target, head, ids: torch.Tensor, depths: int) -> torch.Tensor:
    """ids [T] (prompt + answer) -> [depths, T] rank of the true token x[t + 2 + k] at step k (-1: off the vocab)."""
    from eyas.models.native import rope_tables
    from eyas.train.eagle3 import TTTAttention, shift_left

    t = ids.shape[0]
    pos = torch.arange(t)[None]
    aux = head.cfg.aux_layers
    out = target.forward(ids[None], pos, target.new_cache(1, t), 0, None, aux)
    dt = head.fc.weight.dtype
    hid = head.fuse(torch.stack([out.taps[i] for i in aux], dim=-2))  # [1, T, H]
    emb = target.embed(ids[None]).to(dt)
    attn = TTTAttention(head.midlayer.self_attn)
    draft_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    draft_of[head.draft_ids()] = torch.arange(head.draft_ids().shape[0])
    rows = []
    for k in range(depths):
        rope = rope_tables(head.inv_freq, pos + k, dt)
        hid = head.midlayer.finish(hid, attn(head.midlayer.attn_input(shift_left(emb, 1 + k), hid), rope))
        logits = head.logits(hid)[0].float()  # [T, Vd]
        true = draft_of[shift_left(ids[None], 2 + k)[0]]  # [T] draft index of the true token, -1 if none
        own = logits.gather(1, true.clamp(min=0)[:, None])
        rank = (logits > own).sum(1)
        rows.append(torch.where(true >= 0, rank, -1))
    return torch.stack(rows)


def path_reach(ranks: torch.Tensor, first: int, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which depths a tree of max_rank children a level reaches along one text, at every answer position.

    ranks [D, T] from ranks_along; first = the prompt's length - 1 (the head at position t drafts x[t + 2 ...], the
    root x[t + 1] being the target's). Returns (reached [D, P], kept [D, P]) for P = T - 2 - first positions:
    depth k is reached while it lies inside the text and every depth above it was drafted (rank < max_rank; deeper
    depths are not conditioned on a drafted path otherwise), and kept where its own rank is < max_rank too.
    """
    d, t = ranks.shape
    pos = torch.arange(first, t - 2)  # [P]
    r = ranks[:, first : t - 2]  # [D, P]
    inside = torch.arange(d)[:, None] < (t - 2 - pos)[None]  # depth k exists: x[t + 2 + k] is in the text
    kept = inside & (r >= 0) & (r < max_rank)
    above = torch.cat([torch.ones_like(kept[:1]), kept[:-1]]).cumprod(0).bool()  # every depth above was kept
    reached = inside & above
    return reached, kept & reached


def depth_counts(ranks: torch.Tensor, first: int, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen [D], hits [D, max_rank]) along one text: hits[k, r] counts depth k reached, the true token at rank r."""
    reached, kept = path_reach(ranks, first, max_rank)
    r = ranks[:, first : ranks.shape[1] - 2].clamp(0, max_rank - 1)
    hits = torch.zeros(ranks.shape[0], max_rank).scatter_add_(1, r, kept.float())
    return reached.sum(1).float(), hits


def top1_chains(ranks: torch.Tensor, first: int) -> torch.Tensor:
    """[P] the head's accepted top-1 chain at every answer position (leading depths where its top-1 was the truth)."""
    return path_reach(ranks, first, 1)[1].sum(0)


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
    from eyas.autotree import weights_digest
    from eyas.formats.eagle3 import load_eagle3

    spec = eyas.load(drafter="none", dtype=a.dtype)
    target = spec.target.model
    head = load_eagle3(Path(a.head), target.config, target.dtype).float()
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    hits = torch.zeros(a.depths, a.ranks)
    seen = torch.zeros(a.depths)
    texts = []
    for q in qs:
        prompt = spec.encode(q)
        answer = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False).token_ids
        ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
        texts.append((ids, prompt.shape[0]))
        n_seen, n_hits = depth_counts(ranks_along(target, head, ids, a.depths), prompt.shape[0] - 1, a.ranks)
        seen, hits = seen + n_seen, hits + n_hits
    profile = (hits / seen.clamp(min=1)[:, None]).tolist()
    tree_tau = replay_trees(target, Path(a.head), texts, tuple(int(k) for k in a.top_ks.split(",")), a.depths,
                            a.max_total)
    out = Path(a.out or Path(a.head) / "profile.json")
    out.write_text(json.dumps({
        "rank_accept": [[round(p, 4) for p in row] for row in profile],
        "weights": weights_digest(Path(a.head)),  # eyas.autotree ignores the profile once the weights change
        "positions_per_depth": seen.long().tolist(),
        "tree_tau": {f"{k},{d},{t}": round(v, 4) for (k, d, t), v in tree_tau.items()},
        "measured_on": f"{len(qs)} questions of {a.questions}, {a.max_new_tokens} greedy tokens, target {a.dtype}",
        "command": "python scripts/acceptance_profile.py --head HEAD --questions tune.jsonl "
                   f"--limit {a.limit} --max-new-tokens {a.max_new_tokens} --dtype {a.dtype} --top-ks {a.top_ks} "
                   f"--max-total {a.max_total}",
    }, indent=1) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
