"""The compiled RMSNorm (eyas/kernels/rms_norm.cpp) behind eyas.models.native.rms_norm on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas import kernels
from eyas.models.native import RMSNorm, rms_norm

KERNEL = kernels.rms_norm()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for eyas/kernels/rms_norm.cpp")


def norm(d: int, dtype: torch.dtype) -> RMSNorm:
    n = RMSNorm(d, 1e-5)
    n.weight.data = (torch.randn(d, generator=torch.Generator().manual_seed(1)) * 0.3 + 1).to(dtype)
    return n.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [576, 64, 37])  # AVX-512 body, one vector, tail only
def test_matches_float32_reference_and_is_row_invariant(dtype, d):
    n = norm(d, dtype)
    x = (torch.randn(2, 9, d, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.inference_mode():
        y = rms_norm(x, n)
        rows = torch.cat([rms_norm(x.reshape(-1, d)[i : i + 1], n) for i in range(18)]).view_as(y)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, rows)  # a row's bits do not depend on the rows beside it
    ref = F.rms_norm(x.float(), (d,), n.weight.float(), 1e-5)
    tol = {"rtol": 8e-3, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(y.float(), ref, **tol)


def test_strided_input_and_training_path():
    n = norm(64, torch.bfloat16)
    x = torch.randn(3, 5, 128).to(torch.bfloat16)[..., ::2]  # not contiguous (Qwen3's per-head q/k slices)
    with torch.inference_mode():
        torch.testing.assert_close(rms_norm(x, n).float(), F.rms_norm(x.float(), (64,), n.weight.float(), 1e-5),
                                   rtol=8e-3, atol=1e-2)
    n.weight.requires_grad_(True)
    rms_norm(x, n).float().sum().backward()  # with autograd on, torch's op: gradients flow
    assert n.weight.grad is not None
