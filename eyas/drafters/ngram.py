"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier
occurrence of the sequence's own suffix (Saxena 2023; HF ``prompt_lookup_num_tokens``).

Several matches can be merged into a trie (``branches > 1``) so that the target
checks more than one continuation in the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.drafters.base import Drafter, register_drafter
from eyas.tree import make_tree
from eyas.types import DraftOutput, SamplingParams


@dataclass
class NgramConfig:
    max_ngram: int = 3  # longest suffix to look up
    min_ngram: int = 1  # shortest suffix to fall back to
    num_draft: int = 8  # tokens copied per continuation (K)
    branches: int = 1  # distinct continuations merged into one tree

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_draft < 1 or self.branches < 1:
            raise ValueError("num_draft and branches must be >= 1")


def find_continuations(history: torch.Tensor, cfg: NgramConfig) -> list[torch.Tensor]:
    """Continuations ([<=K] long each) after the latest matches of the longest matching suffix.

    history: [n] long. Example: history = [5 7 9 5 7], max_ngram 2 -> suffix [5 7]
    matches at 0, the continuation is [9 5 7] (up to K tokens, never past the end).
    """
    n = history.shape[0]
    for size in range(min(cfg.max_ngram, n - 1), cfg.min_ngram - 1, -1):
        windows = history[: n - 1].unfold(0, size, 1)  # [n - size, size], excludes the suffix itself
        hits = (windows == history[n - size :]).all(dim=1).nonzero().flatten()  # host sync: match list
        if hits.numel() == 0:
            continue
        out, seen = [], set()
        for start in reversed(hits.tolist()):  # latest match first
            cont = history[start + size : start + size + cfg.num_draft]
            key = tuple(cont.tolist())
            if cont.numel() and key not in seen:
                seen.add(key)
                out.append(cont)
            if len(out) == cfg.branches:
                break
        if out:
            return out
    return []


def trie_tree(root: int, conts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge continuations into a trie under ``root``: returns tokens [N], parents [N]."""
    tokens, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}
    for cont in conts:
        node = 0
        for tok in cont.tolist():
            nxt = children.get((node, tok))
            if nxt is None:
                nxt = len(tokens)
                children[(node, tok)] = nxt
                tokens.append(tok)
                parents.append(node)
            node = nxt
    return torch.tensor(tokens), torch.tensor(parents)


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """Drafts by prompt lookup; deterministic, so proposals are point masses."""

    def __init__(self, cfg: NgramConfig | None = None, target=None, tree: str | None = None, **options) -> None:
        if tree not in (None, "chain"):
            raise ValueError(f"the ngram drafter builds its own trie; --tree {tree} does not apply")
        self.cfg = cfg or NgramConfig(**options)
        self.max_nodes = 1 + self.cfg.num_draft * self.cfg.branches

    def propose(self, history: torch.Tensor, sampling: SamplingParams, generator=None) -> DraftOutput:
        conts = find_continuations(history, self.cfg)
        tokens, parents = trie_tree(int(history[-1]), conts)
        return DraftOutput(tree=make_tree(tokens.to(history.device), parents.to(history.device)))
