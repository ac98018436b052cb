"""eyas.tree_replay: τ of every tree shape from one replay of the drafter over a greedy text.

The replay must equal decoding: for each tree, the accepted length it derives at every position
decoding visits is the accepted length decoding measured there (fp32 tiny model, random EAGLE-3
head over a small vocabulary so that drafts do get accepted), and τ is the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.tree.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from eyas.tree_replay import (
    ReplayConfig,
    accepted_table,
    path_ranks,
    replay_text,
    replay_tree,
    text_features,
    trajectory_tau,
    tree_taus,
)


def _builder() -> DynamicTreeBuilder:
    """Root 9; depth 1: 1 (-0.1), 2 (-0.5); depth 2 under 1: 3 (-0.2), 4 (-1.0)."""
    b = DynamicTreeBuilder(DynamicTreeConfig(top_k=2, depth=2, total_tokens=6))
    b.start(9, torch.tensor([-0.1, -0.5]), torch.tensor([1, 2]))
    b.expand(torch.tensor([[-0.2, -1.0], [-0.3, -0.4]]), torch.tensor([[3, 4], [5, 6]]))
    return b


def test_path_ranks_follow_the_ranking_within_each_depth():
    b = _builder()
    # scores: 1:-0.1 2:-0.5 3:-0.3 4:-1.1 5:-0.8 6:-0.9 -> ranking 1, 3, 2, 5, 6, 4
    assert path_ranks(b, [1, 3, 7], 2) == [[0], [0, 1]]
    assert path_ranks(b, [2, 6], 2) == [[1], [2, 4]]  # depth <= 1 keeps 1, 2: node 2 ranks 1
    assert path_ranks(b, [7], 2) == [[], []]


def test_accepted_table_counts_path_nodes_below_each_total():
    acc = accepted_table([[1], [2, 4]], max_total=6)
    assert acc.tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2]]


def test_trajectory_moves_by_accepted_plus_one():
    assert trajectory_tau(np.array([2, 0, 0, 1, 0, 0, 0])) == (7, 4)  # steps at 0, 3, 4 (+2), 6
    assert trajectory_tau(np.array([5, 0])) == (2, 1)  # never past the text's end
    assert trajectory_tau(np.zeros(4, dtype=np.int8)) == (4, 4)


@pytest.fixture
def model(tiny):
    return tiny.native("llama", seed=1, vocab_size=24)


@pytest.mark.parametrize("tree", [(1, 3, 3), (2, 2, 3), (3, 3, 7), (2, 4, 5)])
def test_replay_equals_decoding(model, tree):
    k, d, t = tree
    head = random_eagle3_head(model.config, draft_vocab_size=16, seed=2)
    prompt = torch.tensor([3, 7, 1, 12, 5, 9, 2])
    dec = SpecDecoder(model, Eagle3Drafter(target_model=model, head=head, tree=f"dynamic:{k},{d},{t}"),
                      DecodeConfig(max_new_tokens=60))
    events = list(dec.generate(prompt))
    ids = torch.cat([prompt, *[e.tokens for e in events]])
    visited = np.cumsum([0] + [e.tokens.shape[0] for e in events[1:-1]])  # answer index of each step's root
    accepted = [e.num_accepted for e in events[1:]]

    cfg = ReplayConfig(top_ks=(k,), max_depth=4, max_total=20)
    replayer = Eagle3Drafter(target_model=model, head=head, tree=replay_tree(k, cfg))
    acc = replay_text(replayer, ids, prompt.shape[0], text_features(model, ids, replayer.taps), cfg)
    assert acc.shape == (ids.shape[0] - prompt.shape[0] - 1, 4, 20)
    assert [int(acc[j, d - 1, t - 1]) for j in visited[: len(accepted) - 1]] == accepted[:-1]
    assert sum(accepted) > 0  # drafts were accepted: the comparison is not between zeros
    tau = tree_taus({k: [acc]}, cfg)[k, d, t]
    real = sum(e.tokens.shape[0] for e in events[1:]) / len(events[1:])
    assert tau == pytest.approx(real)
