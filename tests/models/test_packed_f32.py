"""PackedLinear in float32 (eyas/models/packed.py): past the streaming kernel's rows (prefill chunks) the product runs
on a prepacked oneDNN copy. Checked: it serves there and only there, a row gets the same bits at every row count and
position (exact mode pads only below its probed floor), the result is F.linear's within float32 rounding, the off
switch restores F.linear's bits, and exact mode's row-floor cache keys the new GEMM apart from MKL's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import packed
from eyas.models.exact import RowFloor
from eyas.models.packed import PackedLinear, pack_linears_, skinny_rows

pytestmark = pytest.mark.skipif(not packed._AVAILABLE_F32, reason="oneDNN float32 packing unavailable here")


def _layer(k: int, n: int, bias: bool = True, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).requires_grad_(False)
    assert pack_linears_(lin) == 1
    return lin


# SmolLM2's fused q/k/v, gate/up and down projections
@pytest.mark.parametrize("k,n", [(576, 960), (576, 3072), (1536, 576)])
def test_rows_get_the_same_bits_at_every_count_and_position(k, n):
    lin = _layer(k, n)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k + n))
    first = skinny_rows(lin.weight) + 1  # below it the streaming kernel serves (its own row-invariant sums)
    with torch.inference_mode():
        ref = lin(x)
        assert "_eyas_packed" in lin.__dict__  # the packed copy served
        torch.testing.assert_close(ref, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        for m in (first, 20, 33, 40, 64, 100, 128, 129, 257):
            assert torch.equal(lin(x[:m]), ref[:m]), m
        assert torch.equal(lin(x[7:107]), ref[7:107])  # a row's position in the call does not matter
        assert torch.equal(lin(x[None, :50]), ref[None, :50])  # leading dims


def test_few_rows_stay_on_the_streaming_kernel():
    lin = _layer(64, 48)
    x = torch.randn(skinny_rows(lin.weight), 64)
    with torch.inference_mode():
        lin(x)
    assert "_eyas_packed" not in lin.__dict__


def test_off_switch_gives_f_linears_bits(monkeypatch):
    monkeypatch.setattr(packed, "_AVAILABLE_F32", False)
    lin = _layer(576, 960)
    x = torch.randn(40, 576)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert "_eyas_packed" not in lin.__dict__
    assert lin.gemm_kind() == "PackedLinear"


def test_training_takes_f_linear():
    lin = _layer(32, 16).requires_grad_(True)
    x = torch.randn(40, 32)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and "_eyas_packed" not in lin.__dict__


def test_row_floor_cache_keys_the_gemm(tmp_path):
    lin = _layer(64, 48, bias=False)
    floors = RowFloor(tmp_path / "row_floors.json")
    with torch.inference_mode():
        floor = floors(lin)
    assert 1 <= floor <= skinny_rows(lin.weight) + 1
    saved = (tmp_path / "row_floors.json").read_text()
    assert "PackedLinear+dnnl-f32" in saved
