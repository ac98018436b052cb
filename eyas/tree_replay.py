"""Measured τ of every EAGLE-2 tree shape, by replaying a drafter over the target's own greedy texts.

The tree sizer (``eyas.tree.sizing``) needs the tokens a step yields for each (top_k, depth, total).
A model of it from per-depth, per-rank acceptance (depths independent, ranks averaged, every position
weighted alike) runs high, and most for chains: on the shipped head's 24 tuning questions it predicted
τ 1.89 / 2.06 for ``dynamic:1,2,2`` / ``1,3,3`` against 1.79 / 1.94 replayed, and 2.00 against 1.94
for ``dynamic:2,2,3``, where a dynamic tree spends its nodes where *this* step is uncertain. The sizer
then picked a chain that lost (1.36× against 1.41× for ``dynamic:2,2,3`` on MT-bench).

This module measures instead. For a greedy text (prompt + the target's greedy answer) the target's
features at every position come from one forward; the real drafter (the same class, weights and
kernels decoding uses) is then fed the text one token at a time, and at every answer position it
drafts its full candidate set for the largest tree of each top-k. Greedy verification accepts the
longest drafted path that matches the text, so each tree's accepted length follows from the
candidates alone:

* a smaller ``depth`` keeps the first levels of the same expansion (frontiers depend only on the
  levels above them);
* a smaller ``total`` keeps a prefix of the same ranking (a parent ranks before its children,
  ``eyas.tree.dynamic``), so a path node is in the tree iff its rank is below ``total``.

τ of a tree is then replayed as decoding runs it: from the first answer token, each step moves by
its accepted length plus one. Lossless decoding makes the text the same whatever the tree, so the
replay is exact up to the drafter's own rounding (features from one forward, not step by step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eyas.drafters.base import TargetFeatures
from eyas.tree.dynamic import DynamicTreeBuilder, DynamicTreeConfig


@dataclass
class ReplayConfig:
    """Which trees to measure: every (k, depth, total) with k in ``top_ks``, depth <= ``max_depth``,
    total <= min(candidates, ``max_total``).
    """

    top_ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    max_depth: int = 6
    max_total: int = 63


def path_ranks(builder: DynamicTreeBuilder, truth: list[int], max_depth: int) -> list[list[int]]:
    """ranks[d - 1][j]: rank of the true path's node at depth j + 1 among the candidates of depth <= d.

    ``truth`` is the text after the root; the true path follows it while the candidates contain the
    next token under the current node. Ranks follow ``DynamicTreeBuilder.ranking`` (what ``finish`` keeps).
    Pure bookkeeping over the builder's lists.
    """
    tok, par, _ = builder.candidates()
    depth = [0] * len(tok)
    for s in range(1, len(tok)):  # a parent's slot is below its children's
        depth[s] = depth[par[s]] + 1
    path = true_path(tok, par, truth[:max_depth])
    order = builder.ranking()
    out = []
    for d in range(1, max_depth + 1):
        rank = {s: r for r, s in enumerate(s for s in order if depth[s] <= d)}
        out.append([rank[s] for s in path[:d]])
    return out


def true_path(tokens: list[int], parents: list[int], truth: list[int]) -> list[int]:
    """Slots of the candidates the text ``truth`` (the tokens after the root) follows from the root, in depth order:
    the path greedy verification would accept if every candidate were kept.
    """
    children = {(parents[s], tokens[s]): s for s in range(1, len(tokens))}
    path, node = [], 0
    for t in truth:
        node = children.get((node, t), -1)
        if node < 0:
            break
        path.append(node)
    return path


def accepted_table(ranks: list[list[int]], max_total: int) -> np.ndarray:
    """[max_depth, max_total] int8: accepted drafts of the tree keeping depth <= d and the best t candidates."""
    acc = np.zeros((len(ranks), max_total), dtype=np.int8)
    for d, rs in enumerate(ranks):
        for r in rs:  # ranks grow along the path: node j is kept for every total > its rank
            if r < max_total:
                acc[d, r:] += 1
    return acc


def replay_tree(top_k: int, cfg: ReplayConfig) -> str:
    """The --tree of the drafter replayed for ``top_k``: the deepest expansion, its largest total (any total
    drafts the same candidates; ``finish`` is never called).
    """
    most = DynamicTreeConfig(top_k=top_k, depth=cfg.max_depth, total_tokens=1).max_candidates
    return f"dynamic:{top_k},{cfg.max_depth},{min(most, cfg.max_total)}"


@torch.inference_mode()
def text_features(target, ids: torch.Tensor, taps: tuple[int, ...]) -> TargetFeatures:
    """The target's features at every position of ``ids`` [n], from one forward (what ``replay_text`` feeds)."""
    n = ids.shape[0]
    out = target.forward(ids[None], torch.arange(n)[None], target.new_cache(1, n), 0, None, taps)
    return TargetFeatures(hidden=out.hidden[0], taps={k: v[0] for k, v in out.taps.items()})


@torch.inference_mode()
def replay_text(drafter, ids: torch.Tensor, prompt_len: int, feats: TargetFeatures, cfg: ReplayConfig) -> np.ndarray:
    """[answer positions, max_depth, max_total] accepted drafts at each root position of one text.

    ``drafter``: an EAGLE-style drafter built with ``replay_tree(k, cfg)``; ``ids`` [n] = prompt
    (``prompt_len`` tokens) + the target's greedy answer; ``feats``: ``text_features`` of ``ids``.
    """
    tables = [accepted_table(path_ranks(builder, truth, cfg.max_depth), cfg.max_total)
              for builder, truth in draft_along(drafter, ids, prompt_len, feats)]
    return np.stack(tables) if tables else np.zeros((0, cfg.max_depth, cfg.max_total), dtype=np.int8)


@torch.inference_mode()
def draft_along(drafter, ids: torch.Tensor, prompt_len: int, feats: TargetFeatures):
    """At every answer position of one text, the drafter's full candidate set: yields (its expansion's builder,
    the text after the root); the drafter then reads the next token and its feature, as decoding commits it.

    Arguments as ``replay_text``'s. Read each builder before asking for the next: it is reused.
    """
    def rows(a: int, b: int) -> TargetFeatures:
        return TargetFeatures(hidden=feats.hidden[a:b], taps={k: v[a:b] for k, v in feats.taps.items()})

    n = ids.shape[0]
    drafter.start(n + 1)
    drafter.extend(ids[1 : prompt_len + 1], rows(0, prompt_len))  # root: the first answer token
    truth = ids.tolist()
    for j in range(prompt_len, n - 1):
        drafter.draft_candidates(ids[: j + 1])
        yield drafter.expansion.builder, truth[j + 1 :]
        drafter.extend(ids[j + 1 : j + 2], rows(j, j + 1))


def trajectory_tau(acc: np.ndarray) -> tuple[int, int]:
    """(tokens, steps) decoding one text with one tree: acc [positions] accepted drafts at each root position.

    Position 0 is the first answer token (sampled by prefill, not a step); a step at position j
    commits acc[j] drafts and one more token, never past the text's end.
    """
    n, j, tokens, steps = acc.shape[0], 0, 0, 0
    while j < n:
        new = min(int(acc[j]) + 1, n - j)
        tokens, steps, j = tokens + new, steps + 1, j + new
    return tokens, steps


def tree_taus(tables: dict[int, list[np.ndarray]], cfg: ReplayConfig) -> dict[tuple[int, int, int], float]:
    """τ (tokens per step, 1 + accepted) of every tree, from each top-k's per-text tables (``replay_text``)."""
    taus = {}
    for k, texts in tables.items():
        for d in range(1, cfg.max_depth + 1):
            most = DynamicTreeConfig(top_k=k, depth=d, total_tokens=1).max_candidates
            for t in range(1, min(most, cfg.max_total) + 1):
                tokens = steps = 0
                for acc in texts:
                    a, s = trajectory_tau(acc[:, d - 1, t - 1])
                    tokens, steps = tokens + a, steps + s
                if steps:
                    taus[k, d, t] = tokens / steps
    return taus
