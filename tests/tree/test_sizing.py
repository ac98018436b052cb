"""Tree sizing: predicted tau of EAGLE-2 trees, and a deterministic choice given a cost table."""

from __future__ import annotations

import random

import pytest

from eyas.tree.sizing import (
    AcceptanceProfile,
    DraftCost,
    TreeChoice,
    candidate_probs,
    choose_tree,
    interpolate,
    predicted_tau,
)

PROFILE = AcceptanceProfile([[0.5, 0.2], [0.6, 0.1]])
# a realistic shape: the shipped head's kind of profile, decaying with depth and rank
REAL = AcceptanceProfile([
    [0.46, 0.12, 0.06, 0.035, 0.025, 0.018, 0.014, 0.011],
    [0.52, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008],
    [0.55, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008],
    [0.57, 0.11, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008],
    [0.58, 0.11, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008],
    [0.6, 0.1, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008],
])  # fmt: skip
# the bf16 forward-cost shape measured on the AVX512-BF16 VM (docs/benchmarks.md), seconds
BF16 = {1: 0.0399, 2: 0.0406, 4: 0.0413, 8: 0.0432, 16: 0.0631, 33: 0.0801}


def test_candidate_probs_by_hand():
    # level 1: 0.5, 0.2; level 2 (both expanded): 0.5*0.6, 0.5*0.1, 0.2*0.6, 0.2*0.1
    assert candidate_probs(PROFILE, 2, 2) == pytest.approx([0.5, 0.3, 0.2, 0.12, 0.05, 0.02])
    # top_k 1: a chain
    assert candidate_probs(PROFILE, 1, 2) == pytest.approx([0.5, 0.3])
    assert predicted_tau(PROFILE, 2, 2, 3) == pytest.approx(2.0)
    assert predicted_tau(PROFILE, 1, 1, 1) == pytest.approx(1.5)


def test_only_the_k_best_nodes_of_a_level_are_expanded():
    prof = AcceptanceProfile([[0.3, 0.3, 0.2], [0.5], [0.5]])
    # k = 2: level 1 = .3 .3 (ranks beyond 2 are not drafted); level 2 = .15 .0 .15 .0;
    # level 3 expands the 2 best of level 2 (the two .15, ties to the earlier node)
    assert candidate_probs(prof, 2, 3)[:6] == pytest.approx([0.3, 0.3, 0.15, 0.15, 0.075, 0.075])


def test_tau_grows_with_nodes_and_is_capped_by_the_candidates():
    taus = [predicted_tau(REAL, 4, 4, n) for n in range(1, 20)]
    assert all(b >= a for a, b in zip(taus, taus[1:], strict=False))
    assert predicted_tau(REAL, 2, 2, 100) == pytest.approx(predicted_tau(REAL, 2, 2, 6))


def test_interpolate():
    assert interpolate({1: 1.0, 3: 3.0}, 2) == pytest.approx(2.0)
    assert interpolate({2: 1.0, 4: 2.0}, 1) == pytest.approx(1.0)  # flat below
    assert interpolate({2: 1.0, 4: 2.0}, 8) == pytest.approx(4.0)  # last slope above
    assert interpolate({4: 2.0}, 8) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        interpolate({}, 1)


def test_choice_is_deterministic_given_the_table():
    draft = DraftCost(per_step=0.004, per_level=0.003, per_node=0.0002)
    a = choose_tree(BF16, draft, REAL, max_nodes=33)
    items = list(BF16.items())
    random.Random(0).shuffle(items)
    b = choose_tree(dict(items), draft, REAL, max_nodes=33)
    assert a == b and isinstance(a, TreeChoice)
    # pinned: what this table and profile give (changing the model must change this on purpose)
    assert (a.top_k, a.depth, a.total_tokens) == (3, 2, 7), a
    assert a.predicted_tau == pytest.approx(predicted_tau(REAL, a.top_k, a.depth, a.total_tokens))
    step = interpolate(BF16, a.total_tokens + 1) + 0.004 + (a.depth - 1) * (0.003 + a.top_k * 0.0002)
    assert a.step_ms == pytest.approx(1000 * step)
    assert a.predicted_tok_s == pytest.approx(a.predicted_tau / step)
    assert a.spec == "dynamic:3,2,7" and a.to_dict()["tree"] == a.spec


def test_the_choice_is_the_best_of_the_whole_grid():
    draft = DraftCost(per_step=0.004, per_level=0.003, per_node=0.0002)
    c = choose_tree(BF16, draft, REAL, max_top_k=6, max_nodes=20)
    for k in range(1, 7):
        for depth in range(1, 7):
            n_cand = len(candidate_probs(REAL, k, depth))
            for total in range(1, min(19, n_cand) + 1):
                step = interpolate(BF16, total + 1) + 0.004 + (depth - 1) * (0.003 + k * 0.0002)
                assert predicted_tau(REAL, k, depth, total) / step <= c.predicted_tok_s * (1 + 1e-9)


def test_the_hardware_moves_the_choice():
    """Flat forward cost -> a big tree; steep cost (AVX2 fp32-like) -> a small one; costly drafting -> shallow."""
    free = DraftCost()
    flat = choose_tree({1: 0.04, 64: 0.0401}, free, REAL, max_nodes=64)
    steep = choose_tree({1: 0.04, 2: 0.08, 64: 2.56}, free, REAL, max_nodes=64)
    assert flat.total_tokens >= 20 and steep.total_tokens <= 2
    cheap_levels = choose_tree(BF16, DraftCost(per_level=0.0005), REAL, max_nodes=16)
    dear_levels = choose_tree(BF16, DraftCost(per_level=0.02), REAL, max_nodes=16)
    assert dear_levels.depth < cheap_levels.depth
    assert flat.plain_tok_s == pytest.approx(25.0)


def test_bad_profiles():
    with pytest.raises(ValueError):
        AcceptanceProfile([])
    with pytest.raises(ValueError):
        AcceptanceProfile([[0.8, 0.5]])
    with pytest.raises(ValueError):
        AcceptanceProfile([[-0.1]])


def test_extra_tau_of_a_second_source_counts_and_can_grow_the_tree():
    draft = DraftCost(per_step=0.004, per_level=0.003, per_node=0.0002)
    alone = choose_tree(BF16, draft, REAL, max_nodes=33)
    extra = {1: 0.0, 8: 0.5, 33: 6.0}  # grows with the nodes it shares (hybrid lookup chains)
    both = choose_tree(BF16, draft, REAL, max_nodes=33, extra_tau=extra)
    assert both.total_tokens > alone.total_tokens
    n = both.total_tokens + 1
    head = predicted_tau(REAL, both.top_k, both.depth, both.total_tokens)
    assert both.predicted_tau == pytest.approx(head + interpolate(extra, n))
    assert choose_tree(BF16, draft, REAL, max_nodes=33, extra_tau=None) == alone


def test_measured_tree_tau_replaces_the_model_and_bounds_the_search():
    """A profile with tree_tau: its τ as it stands, only its trees searched, chosen deterministically."""
    draft = DraftCost(per_step=0.0002, per_level=0.0007, per_node=0.0002)
    cost = {1: 0.0066, 2: 0.0070, 3: 0.0071, 4: 0.0075, 6: 0.0086}
    # a chain the rank model would pick, and a top-2 tree that really yields more (the dynamic tree's gain)
    measured = {(1, 2, 2): 1.85, (2, 2, 3): 2.11, (2, 2, 5): 2.2}
    model_only = AcceptanceProfile(REAL.rank_accept)
    with_table = AcceptanceProfile(REAL.rank_accept, tree_tau=measured)
    assert predicted_tau(with_table, 2, 2, 3) == 2.11
    assert predicted_tau(with_table, 3, 2, 3) == predicted_tau(model_only, 3, 2, 3)  # not measured: the model
    a = choose_tree(cost, draft, with_table, max_nodes=6)
    assert (a.top_k, a.depth, a.total_tokens) == (2, 2, 3) and a.predicted_tau == 2.11
    step = interpolate(cost, 4) + 0.0002 + (0.0007 + 2 * 0.0002)
    assert a.predicted_tok_s == pytest.approx(2.11 / step)
    assert a == choose_tree(cost, draft, AcceptanceProfile(REAL.rank_accept, tree_tau=dict(reversed(measured.items()))),
                            max_nodes=6)
    # only measured trees, and only those that fit: with 4 nodes at most, (2, 2, 5) is out
    assert choose_tree(cost, draft, with_table, max_nodes=4).spec in ("dynamic:1,2,2", "dynamic:2,2,3")
    assert choose_tree({**cost, 6: 0.0072}, draft, with_table, max_nodes=6).spec == "dynamic:2,2,5"
    with pytest.raises(ValueError, match="tree_tau"):
        AcceptanceProfile(REAL.rank_accept, tree_tau={(0, 2, 2): 1.5})
