"""merge_candidates: one ranked tree from scored head candidates and lookup chains, within a budget."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.tree.merge import Candidates, Chain, merge_candidates

ROOT = 99


def example():
    """The module docstring's example: head root -> a(1) -> c(3), root -> b(2); chain a d e (1 4 5)."""
    base = Candidates(
        tokens=torch.tensor([ROOT, 1, 2, 3]),
        parents=torch.tensor([-1, 0, 0, 1]),
        scores=torch.tensor([0.0, -0.2, -0.9, -1.5]),
    )
    return base, [Chain([1, 4, 5], [-0.5, -0.5, -0.5])]


def _node_paths(tree) -> list[tuple[int, ...]]:
    """Token path from the root to each node, in node order."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(toks)):
        p, node = [], i
        while node >= 0:
            p.append(toks[node])
            node = pars[node]
        out.append(tuple(reversed(p)))
    return out


def paths(tree) -> set[tuple[int, ...]]:
    """Token paths from the root to every node (order-free view of a tree)."""
    return set(_node_paths(tree))


def test_worked_example_from_the_docstring():
    base, chains = example()
    m = merge_candidates(base, chains, budget=4)
    assert m.tree.tokens.tolist() == [ROOT, 1, 4, 2]
    assert m.tree.parents.tolist() == [-1, 0, 1, 0]
    assert m.tree.depth.tolist() == [0, 1, 2, 1]
    assert m.from_chain.tolist() == [False, False, True, False]
    torch.testing.assert_close(m.keys[1:], torch.tensor([-0.2, -0.7, -0.9]))
    assert m.tree.mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]


def test_shared_prefix_counted_once_and_large_budget_keeps_the_union():
    base, chains = example()
    m = merge_candidates(base, chains, budget=100)
    # root, a, b, c from the head; d, e from the chain (a shared)
    assert m.tree.num_nodes == 6
    assert paths(m.tree) == {(ROOT,), (ROOT, 1), (ROOT, 2), (ROOT, 1, 3), (ROOT, 1, 4), (ROOT, 1, 4, 5)}


@pytest.mark.parametrize("budget", range(1, 8))
def test_every_budget_gives_a_valid_ancestor_closed_tree(budget):
    base, chains = example()
    m = merge_candidates(base, chains, budget)
    n = m.tree.num_nodes
    assert n == min(budget, 6)
    par = m.tree.parents.tolist()
    assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, n))  # topological
    keys = m.keys.tolist()
    assert all(keys[i] <= keys[par[i]] for i in range(1, n))  # keys never increase along a path
    assert keys[1:] == sorted(keys[1:], reverse=True)  # ranking order: a prefix cut keeps the best nodes
    # nested: a smaller budget keeps a subset of a larger one's nodes
    assert paths(m.tree) <= paths(merge_candidates(base, chains, budget + 1).tree)


def test_a_confident_chain_displaces_weak_head_nodes():
    base, _ = example()
    strong = [Chain([7, 8, 9], [math.log(0.95)] * 3)]
    m = merge_candidates(base, strong, budget=5)
    assert paths(m.tree) == {(ROOT,), (ROOT, 1), (ROOT, 7), (ROOT, 7, 8), (ROOT, 7, 8, 9)}


def test_siblings_stay_distinct_with_overlapping_chains():
    base, _ = example()
    chains = [Chain([2, 6], [-0.1, -0.1]), Chain([2, 6, 7], [-0.3, -0.3, -0.3]), Chain([1, 3], [-0.1, -0.1])]
    m = merge_candidates(base, chains, budget=100)
    toks, par = m.tree.tokens.tolist(), m.tree.parents.tolist()
    siblings = [(par[i], toks[i]) for i in range(1, len(toks))]
    assert len(siblings) == len(set(siblings))
    assert m.tree.num_nodes == 6  # root, 1, 2, 3 from the head; 6, 7 new under 2; [1, 3] fully shared
    # a shared node keeps the larger score: (1, 3) via the chain scores -0.2, above the head's -1.5
    key_of = {p: k for p, k in zip(_node_paths(m.tree), m.keys.tolist(), strict=True)}
    assert key_of[(ROOT, 1, 3)] == pytest.approx(-0.2)
    assert key_of[(ROOT, 1)] == pytest.approx(-0.1)


def test_deterministic_and_no_chains_is_the_head_rerank():
    base, chains = example()
    a = merge_candidates(base, chains, 4)
    b = merge_candidates(base, chains, 4)
    assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents)
    head_only = merge_candidates(base, [], 3)
    assert head_only.tree.tokens.tolist() == [ROOT, 1, 2] and not head_only.from_chain.any()


def test_bad_inputs():
    base, chains = example()
    with pytest.raises(ValueError, match="budget"):
        merge_candidates(base, chains, 0)
    with pytest.raises(ValueError, match=r"\[M\]"):
        merge_candidates(Candidates(base.tokens, base.parents[:2], base.scores), chains, 3)
