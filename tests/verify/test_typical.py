"""Medusa typical acceptance: thresholds, prefix closure, final token, config."""

from __future__ import annotations

import pytest
import torch

from eyas.tree import make_tree
from eyas.types import Tree
from eyas.verify import TypicalConfig, verify_greedy, verify_typical
from eyas.verify.typical import LOSSY_NOTE

# root distribution: entropy 1.03 nats, alpha * exp(-H) = 0.107, so the threshold
# is posterior_threshold = 0.09: token 2 (p = 0.10) passes, token 3 (p = 0.05) fails
ROOT_PROBS = [0.6, 0.25, 0.1, 0.05]


def tree_of(tokens: list[int], parents: list[int]) -> Tree:
    return make_tree(torch.tensor(tokens), torch.tensor(parents))


def logits_from_probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()


def test_low_but_typical_token_accepted_atypical_rejected() -> None:
    # root children: node 1 = token 3 (p 0.05, rejected), node 2 = token 2 (p 0.10, accepted)
    tree = tree_of([0, 3, 2], [-1, 0, 0])
    logits = logits_from_probs([ROOT_PROBS, [0.1, 0.2, 0.3, 0.4], [0.1, 0.7, 0.1, 0.1]])
    out = verify_typical(tree, logits, temperature=1.0, cfg=TypicalConfig())
    assert out.path.tolist() == [0, 2]
    assert out.tokens.tolist() == [2, 1]  # final token: argmax at node 2


def test_never_accepts_beyond_a_rejected_node() -> None:
    # chain 0 -> 1 (token 3, atypical) -> 2 (token 0, typical under node 1)
    tree = tree_of([0, 3, 0], [-1, 0, 1])
    logits = logits_from_probs([ROOT_PROBS, [0.9, 0.05, 0.03, 0.02], [0.1, 0.2, 0.3, 0.4]])
    out = verify_typical(tree, logits, temperature=1.0)
    assert out.path.tolist() == [0]
    assert out.tokens.tolist() == [0]  # argmax at the root


def test_longest_typical_path_wins_tie_first() -> None:
    #      0          node 1 (token 1) and node 2 (token 2) both typical; only
    #     / \         node 1's child is typical, so path 0-1-3 is the longest
    #    1   2
    #    |   |
    #    3   4
    tree = tree_of([0, 1, 2, 0, 3], [-1, 0, 0, 1, 2])
    flat = [0.25] * 4
    logits = logits_from_probs([ROOT_PROBS, [0.6, 0.3, 0.05, 0.05], [0.9, 0.05, 0.03, 0.02], flat, flat])
    out = verify_typical(tree, logits, temperature=1.0)
    assert out.path.tolist() == [0, 1, 3]
    assert out.tokens.tolist() == [1, 0, 0]
    # with both children leaves, equal depth: the first (lowest index) wins
    out = verify_typical(tree_of([0, 1, 2], [-1, 0, 0]), logits[:3], temperature=1.0)
    assert out.path.tolist() == [0, 1]


def test_entropy_term_lowers_the_threshold_for_flat_distributions() -> None:
    # uniform over 16: p = 0.0625 < 0.09, but alpha * exp(-H) = 0.3 / 16 = 0.019
    vocab = 16
    tree = tree_of([0, 5], [-1, 0])
    logits = torch.zeros(2, vocab)
    assert verify_typical(tree, logits, temperature=1.0).path.tolist() == [0, 1]
    strict = TypicalConfig(posterior_threshold=0.09, posterior_alpha=1.5)  # 1.5/16 = 0.094 -> 0.09
    assert verify_typical(tree, logits, temperature=1.0, cfg=strict).path.tolist() == [0]


def test_temperature_is_applied_before_the_test() -> None:
    tree = tree_of([0, 2], [-1, 0])
    logits = logits_from_probs([ROOT_PROBS, [0.25] * 4])
    assert verify_typical(tree, logits, temperature=1.0).path.tolist() == [0, 1]
    # a colder distribution makes token 2 (p 0.1) much less likely
    assert verify_typical(tree, logits, temperature=0.5).path.tolist() == [0]


def test_argmax_drafts_are_accepted_like_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, generator=gen) * 4
    tokens = [0] + logits[:3].argmax(-1).tolist()
    tree = tree_of(tokens, [-1, 0, 1, 2])
    # an argmax over 8 tokens has p >= 1/8 > posterior_threshold: always typical
    typical = verify_typical(tree, logits, temperature=1.0)
    assert torch.equal(typical.tokens, verify_greedy(tree, logits).tokens)


def test_lossy_is_documented() -> None:
    assert "LOSSY" in LOSSY_NOTE
    assert verify_typical.__doc__ is not None and "LOSSY" in verify_typical.__doc__


def test_config_and_temperature_validation() -> None:
    with pytest.raises(ValueError):
        TypicalConfig(posterior_threshold=1.5)
    with pytest.raises(ValueError):
        TypicalConfig(posterior_alpha=-0.1)
    with pytest.raises(ValueError):
        verify_typical(tree_of([0], [-1]), torch.zeros(1, 4), temperature=0.0)
    with pytest.raises(ValueError):
        verify_typical(tree_of([0, 1], [-1, 0]), torch.zeros(3, 4), temperature=1.0)
