"""Adaptive trees (eyas.tree.budget): the per-step rules by hand, the --tree grammar, the expansion stopping early."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.drafters.expansion import DynamicExpansion, make_expansion
from eyas.tree.budget import StepBudget
from eyas.tree.sizing import AcceptanceProfile, DraftCost, TreeChoice, step_budget

LOG = math.log


def test_total_keeps_the_nodes_that_pay_for_their_rows():
    b = StepBudget(top_k=2, depth=6, feed=0.4, prices=(0.16, 0.16, 0.3, 0.45))
    # p = .95, .41, .20, .08: gains .79, 1.20, 1.26, 1.19 -> 3
    assert b.total([LOG(0.95), LOG(0.41), LOG(0.2), LOG(0.08)]) == 3
    # a free row (price 2 = price 1) is always worth its node, a dear one only for a likely node
    assert b.total([LOG(0.1), LOG(0.01)]) == 2  # .1 - .16 < 0, yet one node is kept, and the second is free
    assert b.total([LOG(0.9), LOG(0.5), LOG(0.1)]) == 2  # the third row costs .14 more than the second
    assert b.total([LOG(0.9), LOG(0.5), LOG(0.2)]) == 3
    assert b.total([LOG(0.99)] * 10) == 4  # never past max_total
    assert b.total([LOG(0.99)]) == 1  # never past the candidates there are
    with pytest.raises(ValueError, match="no candidates"):
        b.total([])


def test_keep_feeding_sums_the_frontiers_path_probabilities():
    b = StepBudget(top_k=2, depth=6, feed=0.4, prices=(0.1,))
    assert b.keep_feeding([LOG(0.41)]) and not b.keep_feeding([LOG(0.39)])
    # each node may be reached and draft a right child: two at .25 and .2 are worth a level, though neither alone is
    assert b.keep_feeding([LOG(0.25), LOG(0.2)]) and not b.keep_feeding([LOG(0.2), LOG(0.15)])
    always = StepBudget(top_k=2, depth=6, feed=0.0, prices=(0.1,))
    assert always.keep_feeding([-1e9])


def test_spec_round_trips_and_bad_specs_say_the_format():
    b = StepBudget(top_k=3, depth=5, feed=0.42, prices=(0.15, 0.15, 0.3))
    assert b.spec == "adaptive:3,5,0.42,0.15/0.15/0.3"
    assert StepBudget.parse(b.spec.split(":", 1)[1]) == b
    assert make_expansion(b.spec).budget == b
    for bad in ("2,6,0.4", "2,6,x,0.1", "2,6,0.4,", "0,6,0.4,0.1", "2,6,1.5,0.1", "2,6,0.4,-1"):
        with pytest.raises(ValueError, match="TOP_K,DEPTH,FEED,PRICE1"):
            make_expansion(f"adaptive:{bad}")


def test_expansion_sizes_are_the_budgets_most():
    exp = make_expansion("adaptive:2,6,0.4,0.1/0.2/0.3")
    assert isinstance(exp, DynamicExpansion)
    assert exp.max_nodes == 4 and exp.max_fed == 10  # 3 drafts + root; k * (depth - 1) fed
    assert make_expansion("adaptive:1,2,0.4,0.1/0.2/0.3").max_nodes == 3  # a 2-deep chain: 2 candidates + root


def _logp(pairs: list[tuple[int, float]], vocab: int = 16) -> torch.Tensor:
    """[V] log-probs with the given (token, prob) and the rest spread evenly."""
    p = torch.full((vocab,), 1e-9)
    for t, q in pairs:
        p[t] = q
    rest = 1 - sum(q for _, q in pairs)
    others = [i for i in range(vocab) if i not in dict(pairs)]
    p[others] = rest / len(others)
    return p.log()


def test_an_unsure_head_stops_feeding_and_a_sure_one_goes_deeper():
    exp = make_expansion("adaptive:2,4,0.5,0.05/0.05/0.3/0.6/0.9/1.2")
    # the root's children at 0.3 + 0.15 < feed 0.5: no head forward at all
    assert exp.start(torch.tensor(9), _logp([(1, 0.3), (2, 0.15)])) is None
    tree = exp.finish()
    assert tree.tokens.tolist() == [9, 1, 2]  # both depth-1 nodes: the second row costs nothing more
    # two children at 0.3 + 0.25 >= 0.5 are fed, though neither alone reaches it
    assert exp.start(torch.tensor(9), _logp([(1, 0.3), (2, 0.25)])) is not None
    # sure: fed to depth 3 (the frontier's probabilities sum to >= 0.5), then the node prices pick 4 of the candidates
    feed = exp.start(torch.tensor(9), _logp([(1, 0.95), (2, 0.03)]))
    assert feed is not None and feed.depth == 1
    feed = exp.grow(torch.stack([_logp([(3, 0.9), (4, 0.05)]), _logp([(5, 0.5), (6, 0.4)])]))
    assert feed is not None and feed.depth == 2  # frontier 3 (.855) and 4 (.048)
    feed = exp.grow(torch.stack([_logp([(7, 0.35), (8, 0.15)]), _logp([(7, 0.6), (8, 0.3)])]))
    assert feed is None  # frontier 7 (.95 * .9 * .35 = .30) and 8 (.13): .43 < .5
    tree = exp.finish()
    # ranked: 1 (.95), 3 (.855), 7 (.30), 8 (.13), 4 (.048) ...; gains - prices: .90, 1.76, 1.80, 1.63 -> 3 drafts
    assert tree.tokens.tolist() == [9, 1, 3, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_the_best_only_rule_stays_for_ab_runs(monkeypatch):
    """EYAS_FEED_RULE=best: the frontier's best path probability alone decides, as before 2026-12-01."""
    monkeypatch.setenv("EYAS_FEED_RULE", "best")
    exp = make_expansion("adaptive:2,4,0.5,0.05/0.05/0.3/0.6/0.9/1.2")
    assert exp.start(torch.tensor(9), _logp([(1, 0.3), (2, 0.25)])) is None  # the sum rule feeds these
    assert exp.start(torch.tensor(9), _logp([(1, 0.55), (2, 0.25)])) is not None


def test_step_budget_prices_rows_at_the_fixed_trees_rate():
    cost = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.016}
    choice = TreeChoice(top_k=2, depth=2, total_tokens=3, predicted_tau=2.0, predicted_tok_s=150.0,
                        plain_tok_s=100.0, step_ms=13.3)
    profile = AcceptanceProfile([[0.6, 0.1], [0.5, 0.1], [0.5, 0.1]])
    b = step_budget(choice, cost, DraftCost(per_step=0.001, per_level=0.0008, per_node=0.0001), profile, max_total=3)
    # price[n] = 150 * (forward(n + 1) - forward(1)): 2 -> .15, 3 -> .225 (interpolated), 4 -> .3
    assert b.prices == pytest.approx((0.15, 0.225, 0.3))
    # feed = 150 * (level .0008 + 2 * .0001 + row (.012 - .010) / 3) / q .5 = 150 * .001667 / .5
    assert b.feed == pytest.approx(0.5, abs=1e-3)
    assert (b.top_k, b.depth) == (2, 3)
    chain = TreeChoice(top_k=1, depth=3, total_tokens=3, predicted_tau=2.0, predicted_tok_s=150.0,
                       plain_tok_s=100.0, step_ms=13.3)
    assert step_budget(chain, cost, DraftCost(), profile).top_k == 2  # a chain has no sibling to keep
    choice.budget = b
    assert choice.spec == b.spec and choice.fixed_spec == "dynamic:2,2,3"
    assert choice.to_dict()["tree"] == b.spec and choice.to_dict()["fixed_tree"] == "dynamic:2,2,3"
