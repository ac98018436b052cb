"""Prompt lookup and a draft head in one tree, verified in one target forward.

Copy-heavy text (code edits, extraction, quoting the prompt) is where prompt lookup wins: a
suffix match copies many tokens at once. Open prose is where a trained head wins. This drafter
proposes both in one tree of ``budget`` nodes: the head's EAGLE-2 candidates (every node its
dynamic expansion scored) and lookup's continuation chains are merged into one trie under the
root, shared prefixes counted once, and the best ``budget - 1`` nodes are kept by one ranking
(``eyas.tree.merge``). A looked-up token scores its parent's score plus ``log(prior)``, where the
prior is the acceptance rate assumed for a match of that suffix length (``lookup_accept``), so a
long, confident match survives as a deep branch and a weak one does not crowd out the head.

Lossless by construction: the tree's tokens are deterministic (no proposal distribution, ``q`` is
None) and siblings are distinct, so greedy and rejection-sampling verification keep the target's
output exactly (eyas.verify.rejection's preconditions).

    drafter = HybridDrafter(head_drafter=Eagle3Drafter(...), cfg=HybridConfig(budget=8))
    eyas generate "..." --drafter hybrid --tree dynamic:4,3,4     # the shipped head + lookup, 5 nodes
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.drafters.base import Drafter, TargetFeatures, get_drafter_factory, register_drafter
from eyas.drafters.expansion import DynamicExpansion
from eyas.drafters.ngram import NgramConfig, find_continuations
from eyas.tree.merge import Candidates, Chain, MergedTree, merge_candidates
from eyas.types import DraftOutput, SamplingParams


@dataclass
class HybridConfig:
    """How lookup joins the head's tree."""

    budget: int = 0  # tree nodes per step, root included; 0 = the head's own tree size
    max_ngram: int = 3  # longest suffix looked up
    min_ngram: int = 1  # shortest suffix to fall back to
    num_draft: int = 8  # tokens copied per continuation
    branches: int = 1  # distinct continuations grafted
    # assumed acceptance rate of a looked-up token after a matched suffix of 1, 2, 3, ... tokens
    # (the last entry for longer suffixes); its log ranks lookup nodes against the head's log-probs
    lookup_accept: tuple[float, ...] = (0.3, 0.5, 0.7)
    # the rates are re-estimated along each sequence from how often lookup's tokens were the target's (LookupStats),
    # lookup_accept weighing as this many observations; 0: the rates stay as given
    prior_weight: float = 8.0

    def __post_init__(self) -> None:
        NgramConfig(self.max_ngram, self.min_ngram, self.num_draft, self.branches)  # validates those four
        self.lookup_accept = tuple(float(p) for p in self.lookup_accept)
        if self.budget < 0 or not self.lookup_accept or not all(0 < p <= 1 for p in self.lookup_accept):
            raise ValueError(f"need budget >= 0 and lookup_accept in (0, 1], got {self.budget}, {self.lookup_accept}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0 (0: fixed lookup_accept), got {self.prior_weight}")


@dataclass
class LookupStats:
    """Lookup's acceptance along one sequence, by matched suffix length (1, 2, ..., the last for longer ones).

    After each step, the chain proposed is walked against the tokens the target committed (accepted drafts and
    its own next token): each chain token reached counts as offered, and as taken if it is the target's token;
    the walk stops at the first miss. The rate for a suffix length is (taken + w * prior) / (offered + w): the
    configured rate until the sequence says otherwise. So copy-heavy text (a quoted paragraph, code being edited)
    earns lookup's chains deep places in the tree, and open prose, where a 1-token match rarely continues, lets the
    head's nodes win (measured on the shipped head: docs/benchmarks.md).
    """

    prior: tuple[float, ...]
    weight: float
    offered: list[int] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.offered = self.offered or [0] * len(self.prior)
        self.taken = self.taken or [0] * len(self.prior)

    def rates(self) -> tuple[float, ...]:
        if self.weight == 0:
            return self.prior
        w = self.weight
        return tuple((t + w * p) / (o + w) for p, o, t in zip(self.prior, self.offered, self.taken, strict=True))

    def observe(self, chain: Chain, committed: list[int]) -> None:
        """chain: the step's lookup chain; committed: the tokens the step added to the text."""
        i = min(chain.suffix, len(self.prior)) - 1
        for drafted, token in zip(chain.tokens, committed, strict=False):  # as far as the step committed
            self.offered[i] += 1
            if drafted != token:
                return
            self.taken[i] += 1


def lookup_chains(history: torch.Tensor, cfg: HybridConfig, accept: tuple[float, ...] | None = None) -> list[Chain]:
    """Continuations after the longest matching suffix of ``history`` ([n] long, on the CPU), scored.

    Example: history [5 7 9 5 7], max_ngram 2 -> suffix [5 7] matched (2 tokens), the chain is
    [9 5 7] with step log-prior log(lookup_accept[1]) per token. ``accept``: rates in place of lookup_accept.
    """
    top = min(cfg.max_ngram, history.shape[0] - 1)
    for size in range(top, cfg.min_ngram - 1, -1):
        ng = NgramConfig(max_ngram=size, min_ngram=size, num_draft=cfg.num_draft, branches=cfg.branches)
        conts = find_continuations(history, ng)
        if conts:
            lp = _step_logp(accept or cfg.lookup_accept, size)
            return [Chain(c.tolist(), [lp] * c.shape[0], suffix=size) for c in conts]
    return []


def _step_logp(accept: tuple[float, ...], size: int) -> float:
    return math.log(max(accept[min(size, len(accept)) - 1], 1e-6))


class SuffixIndex:
    """The latest start of every n-gram (1 .. ``max_ngram`` tokens) that has a token after it, kept as the
    sequence's text grows: a lookup is one dict read instead of scanning the history (``lookup_chains`` over
    tensors: ~0.09 ms a step at a few hundred tokens, measured in the step on the Zen 5 VM).

    Example: after [5, 7, 9, 5, 7] the 2-gram (5, 7) maps to start 0 (its later copy, the suffix itself, has no
    successor yet), so the continuation of the suffix is [9, 5, 7].
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}

    def update(self, history: torch.Tensor) -> None:
        """history: [n] long, the text so far; it extends the text seen before (else the index is rebuilt)."""
        old = len(self.tokens)
        if history.shape[0] < old or (old and int(history[old - 1]) != self.tokens[-1]):
            self.tokens, self.latest, old = [], {}, 0
        if history.shape[0] == old:
            return
        toks = self.tokens
        toks += history[old:].tolist()
        for end in range(max(old - 1, 0), len(toks) - 1):  # n-grams that just got a successor
            for size in range(1, min(self.max_ngram, end + 1) + 1):
                self.latest[tuple(toks[end - size + 1 : end + 1])] = end - size + 1

    def chains(self, cfg: HybridConfig, accept: tuple[float, ...] | None = None) -> list[Chain]:
        """``lookup_chains`` for one branch: the continuation after the latest match of the longest matching suffix."""
        toks = self.tokens
        for size in range(min(cfg.max_ngram, len(toks) - 1), cfg.min_ngram - 1, -1):
            start = self.latest.get(tuple(toks[len(toks) - size :]))
            if start is not None:
                cont = toks[start + size : start + size + cfg.num_draft]
                return [Chain(cont, [_step_logp(accept or cfg.lookup_accept, size)] * len(cont), suffix=size)]
        return []


@register_drafter("hybrid")
class HybridDrafter(Drafter):
    """A head drafter with a dynamic tree, plus prompt-lookup chains, in one ranked tree."""

    def __init__(self, target=None, tree: str | None = None, head: str | Path | None = None,
                 head_drafter: Drafter | None = None, cfg: HybridConfig | None = None, **options) -> None:
        self.head = head_drafter if head_drafter is not None else load_head(target, head, tree)
        if not isinstance(getattr(self.head, "expansion", None), DynamicExpansion) or not hasattr(
                self.head, "draft_candidates"):
            raise ValueError("the hybrid drafter ranks a head's dynamic tree: use --tree dynamic:TOP_K,DEPTH,TOTAL")
        self.cfg = cfg or HybridConfig(**options)
        self.taps = self.head.taps
        self.max_nodes = self.cfg.budget or self.head.max_nodes
        self.last: MergedTree | None = None  # the last proposal's books (tests, diagnostics)
        self._new_sequence()

    def _new_sequence(self) -> None:
        """Per-sequence state (start replaces it, fork gives the twin its own)."""
        self.index = SuffixIndex(self.cfg.max_ngram)
        self.stats = LookupStats(self.cfg.lookup_accept, self.cfg.prior_weight)
        self.pending: list[Chain] = []  # the last proposal's lookup chains, until its tokens are committed

    def start(self, max_slots: int) -> None:
        self.head.start(max_slots)
        self._new_sequence()

    def extend(self, tokens: torch.Tensor, feats: TargetFeatures) -> None:
        if self.pending:
            committed = tokens.tolist()
            for chain in self.pending:
                self.stats.observe(chain, committed)
            self.pending = []
        self.head.extend(tokens, feats)

    def fork(self) -> HybridDrafter:
        twin = copy.copy(self)
        twin.head = self.head.fork()
        twin._new_sequence()
        return twin

    def propose(self, history: torch.Tensor, sampling: SamplingParams, generator=None) -> DraftOutput:
        self.head.draft_candidates(history)  # fills the head's candidate books
        base = Candidates(*self.head.expansion.builder.candidates())  # the head's books, every scored node
        rates = self.stats.rates()
        if self.cfg.branches == 1:
            self.index.update(history)
            chains = self.index.chains(self.cfg, rates)
        else:
            chains = lookup_chains(history.cpu(), self.cfg, rates)
        self.pending = chains
        size = self.head.expansion.total if self.head.expansion.budget is not None else None  # adaptive trees
        self.last = merge_candidates(base, chains, self.max_nodes, size)
        return DraftOutput(tree=self.last.tree.to(history.device))


def load_head(target, head: str | Path | None, tree: str | None) -> Drafter:
    """The head drafter from a directory (default: the target's shipped head) with ``tree`` or its recommended one."""
    from eyas.drafters.loading import detect_kind, recommended_tree, shipped_head

    p = Path(head).expanduser() if head is not None else shipped_head(getattr(target, "name", ""))
    if p is None or not p.is_dir():
        raise ValueError(f"the hybrid drafter needs an EAGLE head: head={head!r} is not a directory, and the "
                         "target has no shipped head (pass head=PATH, e.g. eyas.load(drafter='hybrid', head=...))")
    return get_drafter_factory(detect_kind(p))(target=target, path=p, tree=tree or recommended_tree(p) or "dynamic")
