r"""Merge scored draft candidates from several sources into one tree within a node budget.

The hybrid drafter (``eyas.drafters.hybrid``) verifies prompt lookup and an EAGLE head in one
forward: the head's EAGLE-2 candidates (every node it scored, kept or not) and lookup's
continuation chains are merged into one trie under the root, sharing prefixes, and the
``budget - 1`` best nodes are kept. Scores are in one currency, a log-probability that the node
is accepted: the head's cumulative draft log-prob, and for a looked-up token its parent's score
plus the log of an acceptance prior. A node that both sources propose keeps the larger score.

Ranking is EAGLE-2's: ``key = min(score, parent's key)``, best first, ties to the lower index.
Keys never increase along a path and a parent's index is below its children's, so every prefix
of the ranking is a valid (ancestor-closed) tree.

Worked example (budget 4; head candidates a, b under the root, c under a; lookup chain a d e)::

    head:    root -> a (-0.2) -> c (-1.5)        merged trie, keys:   root
                  -> b (-0.9)                                        /  \
    chain:   a d e, step log-prior -0.5 each                  a -0.2    b -0.9
             a: max(-0.2, -0.5) = -0.2                        /   \
             d: -0.2 - 0.5 = -0.7                        c -1.5   d -0.7
             e: -0.7 - 0.5 = -1.2                                   \
                                                                     e -1.2
    kept (3 best + root): a, d, b -> tokens [root, a, d, b], parents [-1, 0, 1, 0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eyas.tree.build import tree_from_lists
from eyas.types import Tree


@dataclass
class Candidates:
    """Scored candidate nodes below one root; slot order is topological (parent slot < child slot).

    Each field is an [M] tensor or a list of M numbers (the dynamic tree's books hand over lists).
    """

    # [M] long, token of each candidate (slot 0 = the root)
    tokens: torch.Tensor | list[int]
    # [M] long, parent slot of each candidate, -1 for the root
    parents: torch.Tensor | list[int]
    # [M] float, log-prob-like score of each candidate (higher = more likely accepted; root 0)
    scores: torch.Tensor | list[float]


@dataclass
class Chain:
    """A continuation to graft under the root (e.g. a prompt-lookup match)."""

    # [L] token ids, depth 1 .. L
    tokens: list[int]
    # [L] log-prob added per token along the chain (the acceptance prior of each step)
    step_logp: list[float]
    # the matched suffix's length for a lookup chain (which acceptance estimate scored it); 0: not from lookup
    suffix: int = 0


@dataclass
class MergedTree:
    """The merged tree and where its nodes came from."""

    tree: Tree
    # [N] float, the ranking key of each node (root +inf)
    keys: torch.Tensor
    # [N] bool, node was proposed by a chain only (not among the base candidates)
    from_chain: torch.Tensor


def merge_candidates(base: Candidates, chains: list[Chain], budget: int,
                     size: Callable[[list[float]], int] | None = None) -> MergedTree:
    """Graft ``chains`` into ``base`` (sharing prefixes) and keep the ``budget`` best nodes, root included.

    ``size``: draft tokens to keep given the best ``budget - 1`` ranking keys, best first (an adaptive tree's
    ``DynamicExpansion.total``); None keeps them all.
    Returns nodes in ranking order (root first, then best key first), which is topological.
    Reads the candidates on the host: tens of nodes, one sync.
    """
    if budget < 1:
        raise ValueError(f"budget must count at least the root, got {budget}")
    toks, pars, scores = _as_list(base.tokens), _as_list(base.parents), [float(s) for s in _as_list(base.scores)]
    if not len(toks) == len(pars) == len(scores) or any(isinstance(t, list) for t in toks):
        raise ValueError("candidates' tokens, parents and scores must all be [M]")
    scores[0] = 0.0
    n_base = len(toks)
    child = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks, strict=True)) if i > 0}
    for chain in chains:
        node = 0
        for tok, lp in zip(chain.tokens, chain.step_logp, strict=True):
            s = scores[node] + lp
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[(node, tok)] = len(toks)
                toks.append(tok)
                pars.append(node)
                scores.append(s)
            else:
                scores[nxt] = max(scores[nxt], s)
            node = nxt
    keys = [math.inf] * len(toks)
    for i in range(1, len(toks)):  # topological: parents first
        keys[i] = min(scores[i], keys[pars[i]])
    ranked = sorted(range(1, len(toks)), key=lambda i: (-keys[i], i))[: budget - 1]
    if size is not None and ranked:
        ranked = ranked[: size([keys[i] for i in ranked])]
    kept = [0, *ranked]
    node_of = {slot: n for n, slot in enumerate(kept)}
    dev = base.tokens.device if isinstance(base.tokens, torch.Tensor) else None
    tokens = [toks[s] for s in kept]
    parents = [node_of[pars[s]] if s else -1 for s in kept]
    return MergedTree(
        tree=tree_from_lists(tokens, parents, dev),
        keys=torch.tensor([keys[s] for s in kept], device=dev),
        from_chain=torch.tensor([s >= n_base for s in kept], device=dev),
    )


def _as_list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)
