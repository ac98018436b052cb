"""The draft head's SIMD exp and log-softmax (eyas/kernels/vexp.h) and its top-k, bound by the head-step module for
these tests: exp within an ulp or two of the correctly rounded value over the float range, inf, 0 and NaN where e^x
has them; a row's log-softmax torch's to float32 rounding with the same order, at every length (full registers and
a tail); the top-k the k largest with ties to the lower index."""

from __future__ import annotations

import pytest
import torch

from eyas import kernels

STEP = kernels.head_step()
needs_step = pytest.mark.skipif(STEP is None or not STEP.available(), reason="needs the compiled head step (AVX2)")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between float32 tensors of one sign (and zeros)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@needs_step
def test_exp_is_within_two_ulps_of_torch_over_the_float_range():
    x = torch.linspace(-103.0, 88.7, 400_003, dtype=torch.float32)
    got, ref = STEP.exp(x), torch.exp(x.double()).float()  # the correctly rounded value (float64, then rounded)
    assert got.shape == x.shape and got.dtype == torch.float32
    normal = ref >= torch.finfo(torch.float32).tiny
    assert int(_ulps(got[normal], ref[normal]).max()) <= 2
    assert float((got[~normal] - ref[~normal]).abs().max()) <= 2 * 2.0 ** -149  # denormals: absolute ulps


@needs_step
def test_exp_overflows_underflows_and_keeps_nan_as_expf_does():
    x = torch.tensor([0.0, -0.0, 88.8, 89.0, 1e30, float("inf"), -104.0, -1e30, float("-inf"), float("nan")])
    got = STEP.exp(x)
    assert got[:2].tolist() == [1.0, 1.0]
    assert torch.isinf(got[2:6]).all() and (got[2:6] > 0).all()
    assert got[6:9].tolist() == [0.0, 0.0, 0.0]
    assert torch.isnan(got[9])


@needs_step
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 8192, 8195])
def test_log_softmax_is_torchs_to_float_rounding_at_every_length(length):
    g = torch.Generator().manual_seed(length)
    x = (torch.randn(length, generator=g) * 6).bfloat16().float()  # logits as the head rounds them
    got, ref = STEP.log_softmax(x), torch.log_softmax(x.double(), -1).float()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6 * max(1.0, float(ref.abs().max())))
    assert torch.equal(got.argsort(descending=True, stable=True), x.argsort(descending=True, stable=True))
    assert float(got.exp().double().sum()) == pytest.approx(1.0, abs=1e-5)


@needs_step
def test_log_softmax_of_a_row_does_not_depend_on_where_it_lies():
    """Each row's sum runs in a fixed order of its own elements: the same values at another address (here 3 floats
    off a register's alignment) give the same bits."""
    row = torch.randn(8192, generator=torch.Generator().manual_seed(3)) * 4
    buf = torch.zeros(8192 + 3)
    buf[3:] = row
    assert torch.equal(STEP.log_softmax(row), STEP.log_softmax(buf[3:]))


def _reference_top(x: list[float], k: int) -> list[int]:
    """The k largest, best first, equal values by lower index."""
    return sorted(range(len(x)), key=lambda j: (-x[j], j))[:k]


@needs_step
@pytest.mark.parametrize(("length", "k"), [(n, k) for n in (1, 3, 16, 17, 40, 8192, 8197) for k in (1, 2, 3, 8)
                                            if k <= n])
def test_top_k_is_the_k_largest_with_ties_to_the_lower_index(length, k):
    """The call's top-k (16 values at a time against the k-th best so far): many ties (values on a coarse grid),
    rising rows (each chunk holds a new best) and a row whose best comes last."""
    g = torch.Generator().manual_seed(length * 10 + k)
    rows = [torch.randint(0, 6, (length,), generator=g).float(),  # ties everywhere
            torch.arange(length, dtype=torch.float32) * 0.5,  # every chunk beats the last
            torch.cat([torch.zeros(length - 1), torch.ones(1)])]  # the best in the tail
    for x in rows:
        vals, idx = STEP.top_k(x, k)
        ref = _reference_top(x.tolist(), k)
        assert idx.tolist() == ref
        assert torch.equal(vals, x[ref])
