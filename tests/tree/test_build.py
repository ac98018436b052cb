"""Tests of eyas.tree.build: masks, depths and paths of hand-built trees."""

import pytest
import torch

from eyas.tree import ancestor_mask, chain_tree, make_tree, tree_paths


def _naive_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_worked_example():
    """The module docstring's tree.

        0
       / \\
      1   2
     / \\
    3   4
    """
    tree = make_tree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1, 1]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2]
    assert tree.tokens.tolist() == [10, 11, 12, 13, 14]
    assert tree.num_nodes == 5
    assert tree_paths(tree).tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, -1]]


def test_root_only():
    tree = make_tree(torch.tensor([7]), torch.tensor([-1]))
    assert tree.mask.tolist() == [[True]]
    assert tree.depth.tolist() == [0]
    assert tree_paths(tree).tolist() == [[0]]


def test_deep_unbalanced_tree():
    #   0 - 1 - 2 - 3 - 4 - 5
    #   |       |
    #   6       7 - 8
    parents = [-1, 0, 1, 2, 3, 4, 0, 2, 7]
    tree = make_tree(torch.zeros(9, dtype=torch.long), torch.tensor(parents))
    assert tree.depth.tolist() == [0, 1, 2, 3, 4, 5, 1, 3, 4]
    assert torch.equal(tree.mask, _naive_mask(parents))
    assert tree_paths(tree).tolist() == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 7, 8, -1],
        [0, 6, -1, -1, -1, -1],
    ]


def test_chain_tree_matches_make_tree():
    tokens = torch.tensor([5, 6, 7, 8])
    chain = chain_tree(tokens)
    ref = make_tree(tokens, torch.tensor([-1, 0, 1, 2]))
    assert torch.equal(chain.parents, ref.parents)
    assert torch.equal(chain.depth, ref.depth)
    assert torch.equal(chain.mask, ref.mask)
    assert torch.equal(chain.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree_paths(chain).tolist() == [[0, 1, 2, 3]]


def test_random_trees_match_naive():
    gen = torch.Generator().manual_seed(0)
    for n in [1, 2, 3, 7, 64, 150]:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = make_tree(torch.arange(n), torch.tensor(parents))
        naive = _naive_mask(parents)
        assert torch.equal(tree.mask, naive)
        assert torch.equal(tree.depth, naive.sum(1) - 1)
        paths = tree_paths(tree)
        has_child = set(parents[1:])
        leaves = [i for i in range(n) if i not in has_child]
        assert paths.shape == (len(leaves), int(tree.depth.max()) + 1)
        assert sorted(int(row[row >= 0][-1]) for row in paths) == leaves
        for row in paths:
            nodes = row[row >= 0].tolist()
            assert nodes[0] == 0
            assert all(parents[b] == a for a, b in zip(nodes, nodes[1:], strict=False))
        assert paths.tolist() == sorted(paths.tolist(), key=lambda r: [x if x >= 0 else n for x in r])


def test_ancestor_mask_accepts_forest():
    # two roots: ancestor_mask itself does not require a single root
    mask = ancestor_mask(torch.tensor([-1, 0, -1, 2]))
    assert torch.equal(mask, _naive_mask([-1, 0, -1, 2]))


@pytest.mark.parametrize(
    "parents, match",
    [
        ([0, 0, 1], r"parents\[0\] must be -1"),
        ([-1, 0, 2], r"node 2 has parent 2"),
        ([-1, 0, 3, 1], r"node 2 has parent 3"),
        ([-1, -1, 0], r"node 1 has parent -1"),
    ],
)
def test_make_tree_rejects_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        make_tree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def test_make_tree_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[N\]"):
        make_tree(torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="at least its root"):
        make_tree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[K \+ 1\]"):
        chain_tree(torch.zeros(2, 2, dtype=torch.long))


def test_tree_from_lists_equals_make_tree():
    from eyas.tree.build import tree_from_lists

    gen = torch.Generator().manual_seed(7)
    for n in (1, 2, 5, 17, 40):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
        got, ref = tree_from_lists(tokens, parents), make_tree(torch.tensor(tokens), torch.tensor(parents))
        for field in ("tokens", "parents", "depth", "mask"):
            assert torch.equal(getattr(got, field), getattr(ref, field)), (n, field)
