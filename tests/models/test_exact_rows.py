"""Exact mode's row-floor probes: what they answer, padding below the floor, and the on-disk store."""

from __future__ import annotations

import torch
from torch import nn

from eyas.models import exact
from eyas.models.exact import RowFloor, linear, row_floor


@torch.no_grad()
def test_every_row_count_from_the_floor_up_agrees():
    """Whatever the kernels (fp32 GEMMs are often not row-invariant at small shapes), from the probed floor up a
    row's bits do not depend on how many rows share the product."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        lin = nn.Linear(96, 40, bias=True).to(dtype)
        floor = row_floor(lin, max_rows=16)
        x = torch.randn(16, 96).to(dtype)
        ref = lin(x)
        for m in range(floor, 16):
            assert torch.equal(lin(x[:m]), ref[:m]), (dtype, m)


class OddSingleRow(nn.Module):
    """A layer whose 1-row result differs from its multi-row result (what a GEMV kernel can do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias, self.in_features = nn.Parameter(torch.randn(4, 8), requires_grad=False), None, 8

    def exact(self, x):  # elementwise products and a per-row sum: row-invariant by construction
        return (x[..., None, :] * self.weight).sum(-1)

    def forward(self, x):
        y = self.exact(x)
        return y + 1e-3 if x.reshape(-1, 8).shape[0] == 1 else y


def test_a_different_one_row_kernel_gives_floor_two_and_linear_pads_to_it(tmp_path):
    mod = OddSingleRow()
    assert row_floor(mod, max_rows=8) == 2
    floors = RowFloor(tmp_path / "floors.json")
    x = torch.randn(1, 1, 8)
    padded = linear(mod, x, floors)  # one row padded to two: the multi-row kernel's bits
    assert torch.equal(padded, mod.exact(x))
    assert not torch.equal(linear(mod, x, None), padded)


def test_store_answers_without_probing(tmp_path, monkeypatch):
    lin = nn.Linear(16, 8, bias=False)
    first = RowFloor(tmp_path / "floors.json")
    floor = first(lin)
    assert (tmp_path / "floors.json").exists()

    def no_probe(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(exact, "row_floor", no_probe)
    assert RowFloor(tmp_path / "floors.json")(lin) == floor
