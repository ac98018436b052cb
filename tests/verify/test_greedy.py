"""Hand-built greedy verification cases (vLLM's test_rejection_sampler style)."""

from __future__ import annotations

import random

import pytest
import torch

from eyas.kernels import argmax as greedy_tokens
from eyas.tree import make_tree
from eyas.types import Tree
from eyas.verify import verify_greedy
from eyas.verify.greedy import deepest_accepted
from eyas.verify.paths import deepest_passing_path

V = 10


def tree_of(tokens: list[int], parents: list[int]) -> Tree:
    return make_tree(torch.tensor(tokens), torch.tensor(parents))


def logits_with_argmax(argmax: list[int], vocab: int = V) -> torch.Tensor:
    """[N, V] random logits whose row i has its (unique) maximum at argmax[i]."""
    logits = torch.rand(len(argmax), vocab, generator=torch.Generator().manual_seed(len(argmax)))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 2.0
    return logits


def check(tree: Tree, argmax: list[int], path: list[int], tokens: list[int]) -> None:
    out = verify_greedy(tree, logits_with_argmax(argmax))
    assert out.path.tolist() == path
    assert out.tokens.tolist() == tokens
    assert out.num_accepted == len(path) - 1


def test_chain_all_match_emits_bonus() -> None:
    check(tree_of([9, 1, 2, 3], [-1, 0, 1, 2]), [1, 2, 3, 4], path=[0, 1, 2, 3], tokens=[1, 2, 3, 4])


def test_chain_first_mismatch_emits_only_the_target_token() -> None:
    check(tree_of([9, 1, 2, 3], [-1, 0, 1, 2]), [5, 2, 3, 4], path=[0], tokens=[5])


def test_chain_mismatch_in_the_middle() -> None:
    check(tree_of([9, 1, 2, 3], [-1, 0, 1, 2]), [1, 7, 3, 4], path=[0, 1], tokens=[1, 7])


def test_root_only_tree_emits_just_the_bonus() -> None:
    check(tree_of([9], [-1]), [4], path=[0], tokens=[4])


def test_match_in_a_sibling_branch() -> None:
    #     0            node:  0  1  2  3  4
    #    / \           token: 9  1  2  3  5
    #   1   2          root argmax = 2: branch 1 is rejected, branch 2 accepted
    #   |   |
    #   3   4
    check(tree_of([9, 1, 2, 3, 5], [-1, 0, 0, 1, 2]), [2, 3, 5, 0, 6], path=[0, 2, 4], tokens=[2, 5, 6])


def test_no_acceptance_below_a_rejected_node() -> None:
    # node 3 matches its parent's argmax, but its parent 1 was rejected at the root
    check(tree_of([9, 1, 2, 3], [-1, 0, 0, 1]), [2, 3, 8, 0], path=[0, 2], tokens=[2, 8])


def test_duplicate_siblings_deepest_wins() -> None:
    # nodes 1 and 2 both carry token 4; only node 2's child matches
    check(tree_of([9, 4, 4, 6], [-1, 0, 0, 2]), [4, 0, 6, 7], path=[0, 2, 3], tokens=[4, 6, 7])


def test_duplicate_siblings_tie_goes_to_lowest_index() -> None:
    check(tree_of([9, 4, 4], [-1, 0, 0]), [4, 1, 2], path=[0, 1], tokens=[4, 1])


def test_equal_depth_paths_tie_goes_to_lowest_index() -> None:
    # both branches fully match (duplicate prefix): first leaf wins
    check(tree_of([9, 4, 4, 5, 5], [-1, 0, 0, 1, 2]), [4, 5, 5, 1, 2], path=[0, 1, 3], tokens=[4, 5, 1])


def test_rejects_logits_of_wrong_shape() -> None:
    tree = tree_of([9, 1], [-1, 0])
    with pytest.raises(ValueError):
        verify_greedy(tree, torch.zeros(3, V))
    with pytest.raises(ValueError):
        verify_greedy(tree, torch.zeros(2))


def _reference_walk(tokens: list[int], parents: list[int], argmax: list[int]) -> list[int]:
    """Walk from the root to the (unique, siblings distinct) matching child."""
    path = [0]
    while True:
        nxt = [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == argmax[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    tokens, parents = [0], [-1]
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, n):
        par = rng.randrange(i)
        free = [t for t in range(vocab) if t not in used[par]]
        if not free:
            break
        tok = rng.choice(free)
        used[par].add(tok)
        used[i] = set()
        tokens.append(tok)
        parents.append(par)
    return tokens, parents


def test_matches_a_reference_walk_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(200):
        tokens, parents = _random_tree(rng, rng.randrange(1, 12), vocab=3)
        argmax = [rng.randrange(3) for _ in tokens]
        path = _reference_walk(tokens, parents, argmax)
        out = verify_greedy(tree_of(tokens, parents), logits_with_argmax(argmax, vocab=3))
        assert out.path.tolist() == path
        assert out.tokens.tolist() == [tokens[i] for i in path[1:]] + [argmax[path[-1]]]


def test_host_walk_equals_the_vectorised_rule_with_duplicate_siblings() -> None:
    """``deepest_accepted`` (the list walk verify_greedy runs) = ``deepest_passing_path`` (the tensor rule the
    typical verifier keeps), duplicate siblings and ties included."""
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(1, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [rng.randrange(2) for _ in range(n)]  # two tokens: many duplicate siblings
        argmax = [rng.randrange(2) for _ in range(n)]
        tree = tree_of(tokens, parents)
        passed = tree.tokens == torch.tensor(argmax)[tree.parents.clamp_min(0)]
        assert deepest_accepted(tokens, parents, argmax) == deepest_passing_path(tree, passed).tolist()


def test_greedy_tokens_equal_torch_argmax_ties_nan_and_inf() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randn(1 + trial % 5, 1 + trial * 7 % 300, generator=g)
        if trial % 3 == 0:
            x = torch.round(x)  # ties: the first maximum wins
        if trial % 7 == 0:
            x[-1, trial % x.shape[1]] = float("nan")  # NaN counts as the maximum
        if trial % 11 == 0:
            x[0] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
    wide = torch.randn(4, 49152, generator=g)
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))
    assert torch.equal(greedy_tokens(wide[:, ::2]), wide[:, ::2].argmax(-1))  # strided rows: torch's path
