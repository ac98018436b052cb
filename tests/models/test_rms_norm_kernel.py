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


def test_heads_rope_table_gives_rope_tables_values():
    """The drafting heads index a cached table (eyas.models.layers.RopeTable) instead of building the angles."""
    from eyas.models.config import ModelConfig
    from eyas.models.layers import RopeTable, rope_tables

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=4096)
    table = RopeTable(cfg.inv_freq())
    positions = torch.tensor([[0, 5, 17, 300], [2, 2, 3, 1023]])
    table(positions[:, :2], torch.float32, slots=8)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = table(positions, dtype, slots=1024)  # grown from the 8 slots of the first call
        ref_cos, ref_sin = rope_tables(cfg.inv_freq(), positions, dtype)
        assert cos.shape == ref_cos.shape == (2, 1, 4, 8) and cos.dtype == dtype
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)
