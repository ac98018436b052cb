"""logits_to_probs (temperature, top-k, top-p), sample and greedy."""

from __future__ import annotations

import pytest
import torch

from eyas.types import SamplingParams
from eyas.verify import greedy, logits_to_probs, sample


def _support(probs: torch.Tensor) -> set[int]:
    return set((probs > 0).nonzero().flatten().tolist())


def test_temperature_is_softmax_of_scaled_logits() -> None:
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, dim=-1))


def test_greedy_params_give_one_hot_argmax_first_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 4.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([3.0, 1.0, 4.0, 1.5, 5.0, -2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert _support(probs) == {2, 4}
    expected = torch.softmax(torch.tensor([4.0, 5.0]), dim=-1)
    torch.testing.assert_close(probs[[2, 4]], expected)


def test_top_k_keeps_ties_at_the_kth_value_and_clamps_to_vocab() -> None:
    logits = torch.tensor([2.0, 1.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert _support(probs) == {0, 2}
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=100))
    assert _support(probs) == {0, 1, 2, 3}


# probabilities 0.5, 0.3, 0.15, 0.05 at a permuted position
_NUCLEUS_PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.05, {1}), (0.5, {1}), (0.7, {1, 3}), (0.9, {0, 1, 3}), (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p: float, kept: set[int]) -> None:
    probs = logits_to_probs(_NUCLEUS_PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert _support(probs) == kept
    idx = sorted(kept)
    torch.testing.assert_close(probs[idx], _NUCLEUS_PROBS[idx] / _NUCLEUS_PROBS[idx].sum())


def test_top_k_is_applied_before_top_p() -> None:
    # top-k 3 renormalises to [0.526, 0.316, 0.158]: the first two reach 0.82, so
    # the third is dropped; top-p on the raw probs would have kept it (0.5 + 0.3 < 0.82).
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.82)
    assert _support(logits_to_probs(_NUCLEUS_PROBS.log(), params)) == {1, 3}


def test_rows_sum_to_one_with_all_filters_and_banned_tokens() -> None:
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(1)) * 3
    logits[..., :5] = float("-inf")
    for params in [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.8),
        SamplingParams(temperature=0.0),
    ]:
        probs = logits_to_probs(logits, params)
        assert probs.shape == logits.shape
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
        assert bool((probs[..., :5] == 0).all())


def test_top_p_filters_each_row_independently() -> None:
    logits = torch.stack([_NUCLEUS_PROBS.log(), _NUCLEUS_PROBS.flip(0).log()])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert _support(probs[0]) == {1, 3}
    assert _support(probs[1]) == {0, 2}


def test_sample_is_deterministic_given_the_seed() -> None:
    probs = torch.softmax(torch.randn(64, 10, generator=torch.Generator().manual_seed(2)), dim=-1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    c = sample(probs, torch.Generator().manual_seed(8))
    assert a.shape == (64,) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sample_never_picks_zero_probability_tokens() -> None:
    probs = torch.zeros(20_000, 8)
    probs[:, 3] = 1e-30  # tiny but positive: the only support
    probs[:, 6] = 2e-30
    tokens = sample(probs, torch.Generator().manual_seed(3))
    assert set(tokens.unique().tolist()) == {3, 6}


def test_sample_frequencies_match_unnormalised_probs() -> None:
    weights = torch.tensor([4.0, 0.0, 1.0, 2.0, 3.0])  # sums to 10, not normalised
    n = 40_000
    tokens = sample(weights.expand(n, -1), torch.Generator().manual_seed(4))
    freq = torch.bincount(tokens, minlength=5).double() / n
    probs = weights.double() / weights.sum()
    # within 5 binomial standard errors of the expected frequency, per token
    tolerance = 5 * (probs * (1 - probs) / n).sqrt()
    assert freq[1] == 0
    assert bool(((freq - probs).abs() <= tolerance).all()), (freq, probs)


def test_sample_keeps_leading_dimensions() -> None:
    probs = torch.softmax(torch.randn(2, 3, 5), dim=-1)
    assert sample(probs, torch.Generator().manual_seed(0)).shape == (2, 3)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]])
    assert greedy(logits).tolist() == [1, 0]
