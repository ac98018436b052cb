"""eyas.train.profile's per-depth counting (used by eyas train's profile.json, scripts/acceptance_profile.py,
head_fit.py and datastore_lookup.py) against the plain loop it replaced: a depth counts as reached while every depth
above it was drafted, and only inside the text."""

import pytest
import torch


@pytest.fixture(scope="module")
def ap():
    from eyas.train import profile

    return profile


def loop_counts(ranks: torch.Tensor, first: int, max_rank: int):
    """The reference: walk each position's path depth by depth until it leaves the tree or the text."""
    d, n = ranks.shape
    seen, hits, chains = torch.zeros(d), torch.zeros(d, max_rank), []
    for t in range(first, n - 2):
        chain = 0
        for k in range(min(d, n - 2 - t)):
            seen[k] += 1
            r = int(ranks[k, t])
            if not 0 <= r < max_rank:
                break
            hits[k, r] += 1
            chain += r == 0 and chain == k
        chains.append(chain)
    return seen, hits, chains


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_rank", [1, 3])
def test_counts_match_the_loop(ap, seed, max_rank):
    g = torch.Generator().manual_seed(seed)
    d, n = 5, int(torch.randint(4, 40, (1,), generator=g))
    ranks = torch.randint(-1, 4, (d, n), generator=g)  # -1: off the draft vocabulary
    first = int(torch.randint(0, n - 2, (1,), generator=g))
    seen, hits, chains = loop_counts(ranks, first, max_rank)
    got_seen, got_hits = ap.depth_counts(ranks, first, max_rank)
    assert torch.equal(got_seen, seen)
    assert torch.equal(got_hits, hits)
    if max_rank == 1:
        assert ap.top1_chains(ranks, first).tolist() == chains


def test_hand_built_path(ap):
    # one position with 4 depths inside the text: ranks 0, 0, 2, 0 -> top-1 chain 2; with 3 children a level the
    # path reaches every depth (rank 2 is drafted), so depth 4 counts its rank 0 too
    ranks = torch.tensor([[0, 9], [0, 9], [2, 9], [0, 9]])
    ranks = torch.cat([ranks, torch.full((4, 4), 9)], 1)  # T = 6: position 0 sees depths 1..4, position 1 three
    assert ap.top1_chains(ranks, 0).tolist() == [2, 0, 0, 0]
    seen, hits = ap.depth_counts(ranks, 0, 3)
    assert seen.tolist() == [4, 1, 1, 1]
    assert hits[:, 0].tolist() == [1, 1, 0, 1] and hits[2, 2] == 1
