"""The block kernel's per-CPU options (eyas.models.gguf_tuning): they change the time, never a bit."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from eyas.models import gguf_tuning
from eyas.models.gguf_blocks import GGUFBlocks
from eyas.models.gguf_tuning import SETTINGS, KernelTuning, pick, tune_block_kernel

from .test_gguf_blocks import KERNEL, TYPES, layer, needs_bf16

pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for eyas/kernels/gguf_bf16.cpp")


@pytest.fixture(autouse=True)
def _restore_tuning():
    """The process's tuning as it was before the test (a load earlier in the session may have set it)."""
    before = gguf_tuning._active, gguf_tuning._applied
    yield
    if KERNEL is not None and KERNEL.available():
        KERNEL.set_tuning(before[0].prefetch, before[0].pair_as_triple)
    gguf_tuning._active, gguf_tuning._applied = before


@needs_bf16
@pytest.mark.parametrize("qtype", TYPES)
def test_every_setting_gives_the_same_bits_at_every_row_count(qtype):
    lin = layer(qtype, 72, 576, bias=True, seed=3)
    blocks = lin.__dict__["_eyas_blocks"]
    x = torch.randn(12, lin.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    gguf_tuning.apply(KERNEL, KernelTuning())
    ref = {m: blocks.linear(x[:m], lin.bias).view(torch.int16) for m in range(1, 13)}
    for s in SETTINGS:
        gguf_tuning.apply(KERNEL, s)
        assert gguf_tuning.active() == s
        for m in range(1, 13):
            assert torch.equal(blocks.linear(x[:m], lin.bias).view(torch.int16), ref[m]), (s, m)


def test_pick_takes_the_fastest_and_breaks_ties_towards_the_defaults():
    times = {s: {2: 1.0, 3: 1.0, 4: 1.0} for s in SETTINGS}
    assert pick(times) == KernelTuning()  # all equal: the built-in defaults (first in SETTINGS)
    for r in (2, 3, 4):
        times[KernelTuning(False, False)][r] = 0.8
        times[KernelTuning(False, True)][r] = 0.9
    assert pick(times) == KernelTuning(prefetch=False, pair_as_triple=False)


def test_pair_as_triple_is_judged_on_two_rows_alone():
    """It only changes 2-row blocks: noise at 3-4 rows (the same code, timed twice) must not decide it."""
    times = {s: {2: 1.0, 3: 1.0, 4: 1.0} for s in SETTINGS}
    times[KernelTuning(False, True)].update({2: 0.9, 3: 0.5, 4: 0.5})  # lucky at 3-4 rows, slower at 2
    times[KernelTuning(False, False)].update({2: 0.8, 3: 0.7, 4: 0.7})
    assert pick(times) == KernelTuning(prefetch=False, pair_as_triple=False)
    times[KernelTuning(False, False)][2] = 0.95  # now the triple is faster at 2 rows too
    assert pick(times) == KernelTuning(prefetch=False, pair_as_triple=True)
    # prefetch is judged on every width: faster at 2 rows but slower over 3-4 loses
    times[KernelTuning(True, True)].update({2: 0.6, 3: 1.0, 4: 1.0})
    assert pick(times).prefetch is False


def test_tuning_from_the_environment_is_parsed_or_refused_with_the_fix():
    assert KernelTuning.parse("0,1") == KernelTuning(prefetch=False, pair_as_triple=True)
    with pytest.raises(ValueError, match="PREFETCH,PAIR_AS_TRIPLE"):
        KernelTuning.parse("fast")


class FakeKernel:
    """Records set_tuning; linear is slow under prefetch (so timing picks prefetch off)."""

    def __init__(self):
        self.calls, self.prefetch = [], True

    def set_tuning(self, prefetch, pair):
        self.calls.append((prefetch, pair))
        self.prefetch = prefetch

    def linear(self, x, data, qtype, bias):
        if self.prefetch:
            sum(range(20000))  # burn time: the prefetch settings lose
        return x


def block_model() -> nn.Module:
    m = nn.Linear(64, 8)
    m.__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.zeros(8, 68, dtype=torch.uint8), qtype=8, k=64)
    return m


def test_the_choice_is_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_GGUF_TUNING", raising=False)
    fake = FakeKernel()
    model = nn.Sequential(block_model())
    got = tune_block_kernel(model, tmp_path, kernel=fake)
    assert got.prefetch is False
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"] == {"prefetch": False,
                                                                              "pair_as_triple": got.pair_as_triple}
    fake2 = FakeKernel()
    assert tune_block_kernel(model, tmp_path, kernel=fake2) == got
    assert fake2.calls == [(got.prefetch, got.pair_as_triple)]  # no timing: one call, the cached choice
    monkeypatch.setenv("EYAS_GGUF_TUNING", "1,1")
    assert tune_block_kernel(model, tmp_path, kernel=fake2) == KernelTuning(True, True)
    assert tune_block_kernel(nn.Linear(4, 4), tmp_path, kernel=fake2) is None  # no block projections


def test_a_heads_blocks_are_timed_only_when_nothing_set_the_tuning(tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_GGUF_TUNING", raising=False)
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    timed = []

    def fake_tune(model):
        timed.append(model)
        return KernelTuning(False, True)

    monkeypatch.setattr(gguf_tuning, "tune_block_kernel", fake_tune)
    monkeypatch.setattr(gguf_tuning, "_applied", True)  # the target's blocks set it at load
    monkeypatch.setattr(gguf_tuning, "_active", KernelTuning(False, False))
    head = nn.Sequential(block_model())
    assert gguf_tuning.tune_once(head) == KernelTuning(False, False) and timed == []
    monkeypatch.setattr(gguf_tuning, "_applied", False)  # a target without blocks (an HF directory)
    assert gguf_tuning.tune_once(head) == KernelTuning(False, True) and timed == [head]
