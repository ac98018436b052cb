"""Tests of eyas.tree.dynamic: EAGLE-2 expand / rerank bookkeeping."""

import pytest
import torch

from eyas.tree import DynamicTreeBuilder, DynamicTreeConfig, make_tree

T = torch.tensor


def _hand_built(total: int):
    """top_k = 2, depth = 3, with these cumulative scores (slot: token, score):

    root 0: 100
    depth 1: 1: 10 (-0.1)   2: 11 (-1.0)                  frontier [1, 2]
    depth 2: 3: 20 (-0.3)   4: 21 (-2.1)   (children of 1)
             5: 22 (-1.05)  6: 23 (-4.0)   (children of 2) frontier [3, 5]
    depth 3: 7: 30 (-0.8)   8: 31 (-0.9)   (children of 3)
             9: 32 (-1.06) 10: 33 (-6.05)  (children of 5)
    """
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=3, total_tokens=total))
    f1 = b.start(100, T([-0.1, -1.0]), T([10, 11]))
    f2 = b.expand(T([[-0.2, -2.0], [-0.05, -3.0]]), T([[20, 21], [22, 23]]))
    f3 = b.expand(T([[-0.5, -0.6], [-0.01, -5.0]]), T([[30, 31], [32, 33]]))
    return b, (f1, f2, f3)


def test_hand_built_frontiers():
    _, (f1, f2, f3) = _hand_built(5)
    assert f1.indices.tolist() == [1, 2] and f1.tokens.tolist() == [10, 11]
    assert f1.parent_rows.tolist() == [0, 0] and f1.depth == 1
    assert f1.mask.tolist() == [[True, False], [False, True]]
    assert f2.indices.tolist() == [3, 5] and f2.tokens.tolist() == [20, 22]
    assert f2.parent_rows.tolist() == [0, 1] and f2.depth == 2
    # columns: fed frontiers [1, 2] then [3, 5]
    assert f2.mask.tolist() == [[True, False, True, False], [False, True, False, True]]
    assert f3.indices.tolist() == [7, 8] and f3.parent_rows.tolist() == [0, 0]
    assert f3.mask.shape == (2, 6)


@pytest.mark.parametrize(
    "total, kept, parents, tokens",
    [
        (1, [0, 1], [-1, 0], [100, 10]),
        (5, [0, 1, 2, 3, 7, 8], [-1, 0, 0, 1, 3, 3], [100, 10, 11, 20, 30, 31]),
        (6, [0, 1, 2, 3, 5, 7, 8], [-1, 0, 0, 1, 2, 3, 3], [100, 10, 11, 20, 22, 30, 31]),
        (7, [0, 1, 2, 3, 5, 7, 8, 9], [-1, 0, 0, 1, 2, 3, 3, 4], [100, 10, 11, 20, 22, 30, 31, 32]),
    ],
)
def test_hand_built_finish(total, kept, parents, tokens):
    b, _ = _hand_built(total)
    out = b.finish()
    assert out.kept.tolist() == kept
    assert out.tree.parents.tolist() == parents
    assert out.tree.tokens.tolist() == tokens
    assert out.tree.num_nodes == total + 1
    ref = make_tree(out.tree.tokens, out.tree.parents)
    assert torch.equal(out.tree.mask, ref.mask)
    assert torch.equal(out.tree.depth, ref.depth)
    assert out.scores[0] == 0.0


def test_finish_override_and_limits():
    b, _ = _hand_built(5)
    assert b.finish(2).kept.tolist() == [0, 1, 3]
    assert b.finish(10).tree.num_nodes == 11
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        b.finish(11)
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        b.finish(0)


def test_call_order_errors():
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=2, total_tokens=3))
    with pytest.raises(RuntimeError, match="start"):
        b.expand(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[top_k\] = \[2\]"):
        b.start(0, torch.zeros(3), torch.zeros(3, dtype=torch.long))
    b.start(0, torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        b.expand(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    b.expand(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="depth 2"):
        b.expand(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


def test_ties_keep_parents_and_lower_slots():
    # child log-prob 0 makes a child tie with its parent and with the parent's sibling
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=2, total_tokens=1))
    b.start(0, T([-1.0, -1.0]), T([1, 2]))
    f = b.expand(T([[0.0, -5.0], [0.0, -5.0]]), T([[3, 4], [5, 6]]))
    assert f.indices.tolist() == [3, 5]  # slots 3 and 5 tie at -1.0
    assert b.finish(1).kept.tolist() == [0, 1]
    assert b.finish(2).kept.tolist() == [0, 1, 2]
    assert b.finish(3).kept.tolist() == [0, 1, 2, 3]
    assert b.finish(3).tree.parents.tolist() == [-1, 0, 0, 1]


def test_all_equal_scores_are_deterministic():
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=3, depth=3, total_tokens=10))
    b.start(0, torch.zeros(3), T([1, 2, 3]))
    f = b.expand(torch.zeros(3, 3), torch.arange(9).view(3, 3))
    assert f.indices.tolist() == [4, 5, 6]
    b.expand(torch.zeros(3, 3), torch.arange(9).view(3, 3))
    assert b.finish().kept.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_positive_scores_still_keep_ancestors():
    # raw scores above 0 would rank a child above its parent; the key clamps it
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=2, total_tokens=1))
    b.start(0, T([-3.0, -1.0]), T([1, 2]))
    b.expand(T([[5.0, -9.0], [-9.0, -9.0]]), T([[3, 4], [5, 6]]))
    assert b.finish(1).kept.tolist() == [0, 2]
    assert b.finish(2).kept.tolist() == [0, 2, 1]  # depth 1 by score: slot 2 (-1) then 1 (-3)
    assert b.finish(3).tree.parents.tolist() == [-1, 0, 0, 2]


def _run_random(cfg: DynamicTreeConfig, gen: torch.Generator, signed: bool):
    """Drive a builder with random scores; return it, the frontiers and the logps."""
    k = cfg.top_k

    def scores(*shape):
        x = torch.randn(*shape, generator=gen)
        return x if signed else -x.abs()

    b = DynamicTreeBuilder(cfg)
    frontiers = [b.start(7, scores(k), torch.randint(0, 1000, (k,), generator=gen))]
    for _ in range(cfg.depth - 1):
        frontiers.append(b.expand(scores(k, k), torch.randint(0, 1000, (k, k), generator=gen)))
    return b, frontiers


@pytest.mark.parametrize("signed", [False, True])
def test_random_trees_are_valid(signed):
    gen = torch.Generator().manual_seed(1234)
    configs = [(1, 1, 1), (1, 5, 5), (2, 3, 7), (3, 4, 20), (4, 4, 30), (8, 6, 48), (10, 6, 60)]
    for top_k, depth, total in configs:
        cfg = DynamicTreeConfig(top_k=top_k, depth=depth, total_tokens=total)
        for _ in range(3):
            b, frontiers = _run_random(cfg, gen, signed)
            out = b.finish()
            tree, kept = out.tree, out.kept
            n = total + 1
            assert tree.num_nodes == n and kept.shape == (n,)
            assert len(set(kept.tolist())) == n and int(kept[0]) == 0
            # topological order: parents first, sorted by depth
            assert int(tree.parents[0]) == -1
            assert (tree.parents[1:] >= 0).all()  # every kept node's parent is kept
            assert (tree.parents[1:] < torch.arange(1, n)).all()
            assert (tree.depth[1:] >= tree.depth[:-1]).all()
            ref = make_tree(tree.tokens, tree.parents)
            assert torch.equal(tree.mask, ref.mask) and torch.equal(tree.depth, ref.depth)
            assert torch.equal(tree.tokens, b.tokens[kept])
            assert int(tree.depth.max()) <= depth
            if not signed:  # log-probs: kept = the top `total` scores, best first per depth
                same = tree.depth[1:] == tree.depth[:-1]
                assert (out.scores[1:][same] <= out.scores[:-1][same]).all()
                best = torch.topk(b.scores[1 : b.num_candidates], total).indices + 1
                assert set(best.tolist()) == set(kept[1:].tolist())
            for d, f in enumerate(frontiers, start=1):
                assert f.depth == d and (b.depth[f.indices] == d).all()
                fed = torch.cat([g.indices for g in frontiers[:d]])
                assert torch.equal(f.mask, b.ancestor_mask(f.indices)[:, fed])
                assert (f.mask.sum(1) == d).all()  # one ancestor-or-self per fed level
                if d > 1:  # parent_rows point at the parents in the previous frontier
                    prev = frontiers[d - 2].indices
                    assert torch.equal(prev[f.parent_rows], b.parents[f.indices])
                if not signed:  # the frontier is the top_k of its level
                    level = (b.depth[: b.num_candidates] == d).nonzero().squeeze(1)
                    best = level[torch.topk(b.scores[level], top_k).indices]
                    assert set(best.tolist()) == set(f.indices.tolist())


def test_builder_is_reusable():
    gen = torch.Generator().manual_seed(5)
    cfg = DynamicTreeConfig(top_k=3, depth=3, total_tokens=9)
    b, _ = _run_random(cfg, gen, signed=False)
    first = b.finish()
    b.start(1, T([-0.5, -1.0, -2.0]), T([4, 5, 6]))
    second = b.finish(3)
    assert second.kept.tolist() == [0, 1, 2, 3] and second.tree.tokens.tolist() == [1, 4, 5, 6]
    assert first.tree.num_nodes == 10  # earlier results do not alias the buffers


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(depth=-1), "depth must be a positive int"),
        (dict(total_tokens=0), "total_tokens must be a positive int"),
        (dict(top_k=2.0), "top_k must be a positive int"),
        (dict(top_k=2, depth=2, total_tokens=7), r"exceeds the 6 candidates"),
        (dict(top_k=3, depth=1, total_tokens=4), r"exceeds the 3 candidates"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicTreeConfig(**kwargs)


def test_config_defaults():
    cfg = DynamicTreeConfig()
    assert (cfg.top_k, cfg.depth, cfg.total_tokens) == (8, 6, 48)
    assert cfg.max_candidates == 8 + 5 * 64
    assert DynamicTreeConfig(top_k=2, depth=2, total_tokens=6).max_candidates == 6
