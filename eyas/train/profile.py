"""A head's acceptance by depth and rank, teacher-forced along texts the target wrote: what eyas.tree.sizing
sizes a tree from (``HEAD/profile.json``, read by eyas.autotree).

At every answer position t the head drafts along the text's own continuation (the training-time-test unroll,
eyas.train.eagle3: step k reads the true token and the head's previous output, what the drafter does at depth
k + 1 of a tree whose path so far is right). rank_accept[d][r] = P(the token at depth d + 1 is the head's rank-r
proposal | every depth above was drafted). For greedy decoding the texts should be the target's greedy answers (the
self-distilled data is). ``scripts/acceptance_profile.py`` adds the replayed trees' τ on tuning questions;
``eyas train`` writes the rank model alone for its export, from the held-aside conversations.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


@torch.inference_mode()
def ranks_along(target, head, ids: torch.Tensor, depths: int) -> torch.Tensor:
    """ids [T] (prompt + answer) -> [depths, T] rank of the true token x[t + 2 + k] at step k (-1: off the vocab)."""
    from eyas.models.native import rope_tables
    from eyas.train.eagle3 import TTTLayers, shift_left

    t = ids.shape[0]
    pos = torch.arange(t)[None]
    aux = head.cfg.aux_layers
    out = target.forward(ids[None], pos, target.new_cache(1, t), 0, None, aux)
    dt = head.fc.weight.dtype
    hid = head.fuse(torch.stack([out.taps[i] for i in aux], dim=-2))  # [1, T, H]
    emb = target.embed(ids[None]).to(dt)
    layers = TTTLayers(head)
    draft_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    draft_of[head.draft_ids()] = torch.arange(head.draft_ids().shape[0])
    rows = []
    for k in range(depths):
        rope = rope_tables(head.inv_freq, pos + k, dt)
        hid = layers(shift_left(emb, 1 + k), hid, rope)
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


def rank_accept(target, head, texts: list[tuple[torch.Tensor, int]], depths: int = 6,
                ranks: int = 8) -> tuple[list[list[float]], list[int]]:
    """texts: (ids [T], first) with the answer starting at ``first + 1`` -> (rank_accept [depths][ranks], positions
    seen per depth).
    """
    hits, seen = torch.zeros(depths, ranks), torch.zeros(depths)
    for ids, first in texts:
        n_seen, n_hits = depth_counts(ranks_along(target, head, ids.cpu(), depths), first, ranks)
        seen, hits = seen + n_seen, hits + n_hits
    return (hits / seen.clamp(min=1)[:, None]).tolist(), seen.long().tolist()


def write_profile(head_dir: Path, target, head, texts: list[tuple[torch.Tensor, int]], measured_on: str,
                  depths: int = 6, ranks: int = 8, extra: dict | None = None, out: Path | None = None) -> Path:
    """``head_dir/profile.json`` (or ``out``) from ``texts``: the rank model, keyed to the weights in ``head_dir``,
    plus ``extra`` fields (scripts/acceptance_profile.py: the replayed trees' τ and its command).
    """
    from eyas.autotree import weights_digest

    accept, seen = rank_accept(target, head, texts, depths, ranks)
    out = Path(out or Path(head_dir) / "profile.json")
    out.write_text(json.dumps({
        "rank_accept": [[round(p, 4) for p in row] for row in accept],
        "weights": weights_digest(Path(head_dir)),  # eyas.autotree ignores the profile once the weights change
        "positions_per_depth": seen,
        "measured_on": measured_on,
        **(extra or {}),
    }, indent=1) + "\n")
    return out
