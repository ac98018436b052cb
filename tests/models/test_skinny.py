"""The few-row float32 projection (eyas/kernels/skinny_gemm.cpp, used by PackedLinear): each row's output is the
same bits however many rows share the call and however many threads run it, and it is F.linear up to float
rounding. Where it serves, plain decoding (1 row) and verification (a tree's rows) agree in every projection.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.models import packed
from eyas.models.layers import vocab_logits
from eyas.models.packed import PackedLinear, pack_linears_, skinny_kernel, skinny_rows

KERNEL = kernels.skinny_gemm()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain to build eyas/kernels/skinny_gemm.cpp")
NONE = torch.empty(0)


# SmolLM2's projections, a vocabulary-sized one, and shapes off the 4-row / 8-lane blocking
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 49152), (13, 7), (37, 130), (8, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_invariant_and_close_to_f_linear(k, n, threads):
    torch.manual_seed(k * n)
    w, x = torch.randn(n, k), torch.randn(32, k)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = KERNEL.linear(x, w, NONE)
        for m in range(1, 33):
            assert torch.equal(KERNEL.linear(x[:m], w, NONE), full[:m]), m  # a prefix of the rows
        for i in range(0, 32, 5):
            assert torch.equal(KERNEL.linear(x[i : i + 1], w, NONE), full[i : i + 1]), i  # a row alone
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-4 * k**0.5)


def test_bias_and_bad_input():
    torch.manual_seed(0)
    w, b, x = torch.randn(10, 24), torch.randn(10), torch.randn(3, 24)
    torch.testing.assert_close(KERNEL.linear(x, w, b), F.linear(x, w, b))
    with pytest.raises(RuntimeError, match="float32"):
        KERNEL.linear(x.double(), w.double(), NONE)
    with pytest.raises(RuntimeError, match="at most"):
        KERNEL.linear(torch.randn(KERNEL.max_rows() + 1, 24), w, NONE)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        KERNEL.linear(x, torch.randn(10, 23), NONE)


def _packed(k: int, n: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=bias).requires_grad_(False)
    pack_linears_(lin)
    assert type(lin) is PackedLinear
    return lin


def test_packed_linear_takes_the_kernel_for_few_float32_rows_only():
    lin = _packed(64, 48, bias=True)
    limit = skinny_rows(lin.weight)
    x = torch.randn(2, 3, 64)  # leading dims flatten to 6 rows
    with torch.inference_mode():
        assert torch.equal(lin(x), KERNEL.linear(x.reshape(6, 64), lin.weight, lin.bias).view(2, 3, 48))
        many = torch.randn(limit + 1, 64)
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))  # past the limit: MKL's GEMM
    trained = _packed(64, 48).requires_grad_(True)
    assert skinny_kernel(trained.weight, x) is None  # autograd keeps F.linear
    assert skinny_kernel(lin.weight.double(), x.double()) is None


def test_vocab_logits_go_through_the_kernel_and_fall_back_without_it(monkeypatch):
    proj = _packed(96, 4096)
    rows = torch.randn(5, 96)
    with torch.inference_mode():
        assert torch.equal(vocab_logits(proj, rows), KERNEL.linear(rows, proj.weight, NONE))
        monkeypatch.setattr(packed, "_skinny", lambda: None)  # as on a machine that cannot build it
        assert skinny_kernel(proj.weight, rows) is None
        torch.testing.assert_close(vocab_logits(proj, rows), F.linear(rows, proj.weight), rtol=1e-5, atol=1e-3)
