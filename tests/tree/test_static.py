"""Tests of eyas.tree.static and the presets: templates, validation, parsing."""

import pytest
import torch

from eyas.tree import PRESETS, StaticTree, make_tree, parse_choices, static_tree, tree_paths

SMALL = [[0], [1], [0, 0], [0, 1], [1, 0]]


def test_small_tree_exact():
    """The worked example of the static module docstring (choices given out of order)."""
    st = static_tree([[1, 0], [0, 1], [0], [0, 0], [1]])
    assert st.choices == SMALL
    assert st.num_nodes == 6
    assert st.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert st.ranks.tolist() == [-1, 0, 1, 0, 1, 0]
    assert st.depth.tolist() == [0, 1, 1, 2, 2, 2]
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(st.mask, expected_mask)
    assert st.paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert st.children.tolist() == [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert st.child_ranks.tolist() == [[0, 1], [0, 1], [0, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert st.topk_per_depth == [2, 2]


def test_rank_gaps_allowed():
    st = static_tree([[2], [0], [2, 3]])
    assert st.choices == [[0], [2], [2, 3]]
    assert st.parents.tolist() == [-1, 0, 0, 2]
    assert st.ranks.tolist() == [-1, 0, 2, 3]
    assert st.child_ranks.tolist()[0] == [0, 2]
    assert st.topk_per_depth == [3, 4]


def test_with_tokens_reuses_template():
    st = static_tree(SMALL)
    tokens = torch.tensor([9, 8, 7, 6, 5, 4])
    tree = st.with_tokens(tokens)
    assert tree.tokens is tokens
    assert tree.mask is st.mask and tree.depth is st.depth and tree.parents is st.parents
    ref = make_tree(tokens, st.parents)
    assert torch.equal(tree.mask, ref.mask) and torch.equal(tree.depth, ref.depth)
    with pytest.raises(ValueError, match=r"\[N\] = \[6\]"):
        st.with_tokens(torch.zeros(5, dtype=torch.long))


def test_to_device_copy():
    st = static_tree(SMALL).to("cpu")
    assert isinstance(st, StaticTree) and st.choices == SMALL


@pytest.mark.parametrize(
    "name, nodes",
    [
        ("mc_sim_7b_63", 26),  # EAGLE's tree: 25 choices despite the name
        ("eagle_mc_sim_7b_63", 26),
        ("medusa_mc_sim_7b_63", 64),
        ("chain4", 5),
        ("chain6", 7),
        ("binary_2x3", 15),
        ("eagle_small", 20),
    ],
)
def test_presets_build(name, nodes):
    st = static_tree(PRESETS[name])
    assert st.num_nodes == nodes
    ref = make_tree(torch.zeros(nodes, dtype=torch.long), st.parents)
    assert torch.equal(st.mask, ref.mask)
    assert torch.equal(st.depth, ref.depth)
    assert torch.equal(st.paths, tree_paths(ref))
    # each child's rank is its choice's last entry and its parent is its prefix
    for i, c in enumerate(st.choices, start=1):
        assert int(st.ranks[i]) == c[-1]
        p = int(st.parents[i])
        assert (st.choices[p - 1] if p > 0 else []) == c[:-1]


def test_medusa_preset_has_63_choices_and_eagle_25():
    assert len(PRESETS["medusa_mc_sim_7b_63"]) == 63
    assert len(PRESETS["eagle_mc_sim_7b_63"]) == 25
    assert static_tree(PRESETS["medusa_mc_sim_7b_63"]).paths.shape[1] == 5


def test_chain_preset_is_a_chain():
    st = static_tree(PRESETS["chain4"])
    assert st.parents.tolist() == [-1, 0, 1, 2, 3]
    assert st.paths.tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    "choices, match",
    [
        ("[[0]]", "must be a list of paths"),
        (None, "must be a list of paths"),
        ([], "empty"),
        ([[0], []], r"\[\] is not a non-empty list"),
        ([[0], 1], "1 is not a non-empty list"),
        ([[0], [-1]], "non-negative"),
        ([[0], [0.5]], "non-negative int"),
        ([[0], [True]], "non-negative int"),
        ([[0], ["0"]], "non-negative int"),
        ([[0], [1], [0]], r"\[0\] appears twice"),
        ([[0, 1]], r"prefix \[0\] is missing"),
        ([[0], [0, 0, 0]], r"prefix \[0, 0\] is missing"),
    ],
)
def test_malformed_choices(choices, match):
    with pytest.raises(ValueError, match=match):
        static_tree(choices)


def test_tuples_accepted():
    assert static_tree(((0,), (0, 0))).choices == [[0], [0, 0]]


def test_parse_preset_names():
    assert parse_choices("mc_sim_7b_63") == sorted(PRESETS["mc_sim_7b_63"], key=lambda c: (len(c), c))
    assert parse_choices("static:chain4") == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert parse_choices("  eagle_small ") == static_tree(PRESETS["eagle_small"]).choices
    # the returned lists are copies: editing them does not change the preset
    parse_choices("chain4")[0].append(5)
    assert PRESETS["chain4"][0] == [0]


def test_parse_literals():
    assert parse_choices("[[0],[1],[0,0]]") == [[0], [1], [0, 0]]
    assert parse_choices("static:[[0], [1], [0, 0]]") == [[0], [1], [0, 0]]
    assert parse_choices("[[1, 0], [1], [0]]") == [[0], [1], [1, 0]]
    assert parse_choices("[(0,), (0, 0)]") == [[0], [0, 0]]


@pytest.mark.parametrize(
    "text, match",
    [
        ("no_such_tree", "unknown tree preset 'no_such_tree'.*chain4"),
        ("", "unknown tree preset"),
        ("[[0], [1]", "could not read"),
        ("[__import__('os').getcwd()]", "could not read"),
        ("[[0, 1]]", "prefix"),
        ("[]", "empty"),
        ("[[0], 'a']", "not a non-empty list"),
    ],
)
def test_parse_garbage(text, match):
    with pytest.raises(ValueError, match=match):
        parse_choices(text)
