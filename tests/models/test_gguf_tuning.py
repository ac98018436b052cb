"""The block kernel's per-CPU options (eyas.models.gguf_tuning): they change the time, never a bit."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from eyas.models import gguf_tuning
from eyas.models.gguf_blocks import GGUFBlocks
from eyas.models.gguf_tuning import (
    FMA_SETTINGS,
    SETTINGS,
    KernelTuning,
    pick,
    pick_one_row,
    settings_for,
    tune_block_kernel,
)

from .test_gguf_blocks import KERNEL, TYPES, layer, needs_bf16

pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for eyas/kernels/gguf_bf16.cpp")


@pytest.fixture(autouse=True)
def _restore_tuning():
    """The process's tuning as it was before the test (a load earlier in the session may have set it)."""
    before = gguf_tuning._active, gguf_tuning._applied
    yield
    if KERNEL is not None and KERNEL.available():
        gguf_tuning.set_on(KERNEL, before[0])
    gguf_tuning._active, gguf_tuning._applied = before


@needs_bf16
@pytest.mark.parametrize("qtype", TYPES)
def test_every_setting_gives_the_same_bits_at_every_row_count(qtype):
    lin = layer(qtype, 72, 576, bias=True, seed=3)
    blocks = lin.__dict__["_eyas_blocks"]
    x = torch.randn(69, lin.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    counts = (*range(1, 13), 64, 65, 66, 69)  # past 64 the kernel runs rows in chunks: 65 ends with a chunk of one
    gguf_tuning.apply(KERNEL, KernelTuning())
    ref = {m: blocks.linear(x[:m], lin.bias).view(torch.int16) for m in counts}
    variants = [replace(s, prefetch_one=o, fused_rows=f) for s in settings_for(KERNEL) for o in (False, True)
                for f in (True, False)]
    for s in variants:
        gguf_tuning.apply(KERNEL, s)
        assert gguf_tuning.active() == s
        for m in counts:
            assert torch.equal(blocks.linear(x[:m], lin.bias).view(torch.int16), ref[m]), (s, m)


@needs_bf16
@pytest.mark.skipif(KERNEL is None or not gguf_tuning.fma_exact(KERNEL), reason="VDPBF16PS is not two FMAs here")
@pytest.mark.parametrize("qtype", TYPES)
def test_fma_rows_fall_back_where_a_denormal_would_change_a_bit(qtype):
    """VDPBF16PS reads a denormal x as zero; an FMA would not (2^-130 * w is a normal float32 for |w| > 2^-4). So x
    with a denormal, or a nonzero |x| < 2^-60, runs on VDPBF16PS, and its rows give their one-row bits."""
    lin = layer(qtype, 64, 576, seed=5)
    blocks = lin.__dict__["_eyas_blocks"]
    w = lin.weight.float()
    x = torch.zeros(4, 576)
    col = int(w.abs().max(dim=0).values.argmax())  # a column with a weight far above 2^-4
    x[0, col] = 2.0 ** -130  # denormal in bf16 (exactly representable)
    x[1, col] = 2.0 ** -100  # normal, but its products could be denormal
    x[2] = torch.randn(576)
    x[3, col] = -(2.0 ** -131)
    x = x.to(torch.bfloat16)
    assert x[0, col].item() != 0
    gguf_tuning.apply(KERNEL, KernelTuning())
    one = torch.stack([blocks.linear(x[i:i + 1], None)[0] for i in range(4)]).view(torch.int16)
    gguf_tuning.apply(KERNEL, FMA_SETTINGS[0])
    assert torch.equal(blocks.linear(x, None).view(torch.int16), one)
    assert torch.equal(blocks.linear(x[2:3].expand(5, -1).contiguous(), None).view(torch.int16), one[2:3].expand(5, -1))


@needs_bf16
def test_several_rows_keep_the_instructions_order_of_products():
    """A lane's odd product is added before its even one: 0.75 + 2^24 - 2^24 is 0 in that order, 1 in the other,
    a difference no bf16 rounding hides. Two Q8_0 blocks (scale 1): block 0 leaves 0.75 in lane 0, block 1 adds
    x[33] * 1 = 2^24 (odd) and x[32] * 1 = -2^24 (even)."""
    raw = np.zeros((4, 2 * 34), dtype=np.uint8)
    raw[:, 0:2] = raw[:, 34:36] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    raw[:, 2 + 0] = 1  # w[0]
    raw[:, 36 + 0] = raw[:, 36 + 1] = 1  # w[32], w[33]
    blocks = GGUFBlocks(data=torch.from_numpy(raw), qtype=8, k=64)
    x = torch.zeros(3, 64)
    x[:, 0], x[:, 32], x[:, 33] = 0.75, -(2.0 ** 24), 2.0 ** 24
    x = x.to(torch.bfloat16)
    for s in (*settings_for(KERNEL), *(replace(s, prefetch_one=True) for s in settings_for(KERNEL))):
        gguf_tuning.apply(KERNEL, s)
        one = blocks.linear(x[:1], None)
        assert torch.equal(blocks.linear(x, None), one.expand(3, -1)), s
        assert one.float().abs().max().item() in (0.0, 1.0)
    if gguf_tuning.fma_exact(KERNEL):  # the Intel SDM's order, which fma_rows reproduces
        assert blocks.linear(x, None).float().abs().max().item() == 0.0


def test_fma_settings_are_offered_only_where_the_kernel_vouches_for_their_bits():
    class Vouching:
        def __init__(self, exact):
            self.exact = exact

        def fma_rows_exact(self):
            return self.exact

    assert settings_for(Vouching(True)) == SETTINGS + FMA_SETTINGS
    assert settings_for(Vouching(False)) == SETTINGS
    assert settings_for(object()) == SETTINGS  # a build from before fma_rows
    with pytest.raises(ValueError, match="EYAS_GGUF_TUNING's third value"):
        gguf_tuning.apply(Vouching(False), KernelTuning(True, False, True))


def test_fma_rows_are_judged_on_every_width():
    order = SETTINGS + FMA_SETTINGS
    times = {s: {2: 1.0, 3: 1.0, 4: 1.0} for s in order}
    times[FMA_SETTINGS[0]].update({2: 1.1, 3: 0.8, 4: 0.8})  # slower at 2 rows, faster over 3-4: wins
    assert pick(times) == FMA_SETTINGS[0]
    times[FMA_SETTINGS[0]].update({2: 1.5})  # now the 2-row loss outweighs the gain over 3-4
    assert pick(times) == KernelTuning()


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


def test_the_prefetch_goes_off_only_for_a_clear_win():
    """A Zen 4 first load on a slow spell (its cached table, ms for SmolLM2's 121 projections) timed the prefetch
    3.7 % behind and turned it off, which cost decoding steps up to a quarter at 2-6 nodes: within the margin it stays.
    """
    ms = {KernelTuning(True, True): {2: 7.795, 3: 8.086, 4: 9.023, 6: 14.762},
          KernelTuning(True, False): {2: 7.208, 3: 8.656, 4: 9.045, 6: 15.185},
          KernelTuning(False, True): {2: 9.516, 3: 9.155, 4: 9.901, 6: 13.656},
          KernelTuning(False, False): {2: 7.358, 3: 8.545, 4: 8.920, 6: 12.845}}
    assert pick(ms) == KernelTuning(prefetch=True, pair_as_triple=False)
    # the same off-setting a clear 10 % faster at every width: off it goes
    ms[KernelTuning(False, False)] = {r: 0.9 * min(ms[KernelTuning(True, t)][r] for t in (True, False)) for r in ms[
        KernelTuning(False, False)]}
    assert pick(ms) == KernelTuning(prefetch=False, pair_as_triple=False)
    # at the margin's edge: off must be more than PREFETCH_MARGIN faster summed
    times = {s: {2: 1.0, 3: 1.0} for s in SETTINGS}
    edge = 1 - gguf_tuning.PREFETCH_MARGIN
    times[KernelTuning(False, False)] = {2: edge, 3: edge}
    assert pick(times).prefetch is True
    times[KernelTuning(False, False)] = {2: edge - 0.01, 3: edge - 0.01}
    assert pick(times) == KernelTuning(prefetch=False, pair_as_triple=False)
    # where nothing prefetches (a caller's own list), the fastest stands
    off = {s: t for s, t in times.items() if not s.prefetch}
    assert pick(off) == KernelTuning(prefetch=False, pair_as_triple=False)


def test_tuning_from_the_environment_is_parsed_or_refused_with_the_fix():
    assert KernelTuning.parse("0,1") == KernelTuning(prefetch=False, pair_as_triple=True)
    assert KernelTuning.parse("1, 0, 1") == KernelTuning(prefetch=True, pair_as_triple=False, fma_rows=True)
    assert KernelTuning.parse("0,0,0,1") == KernelTuning(False, False, False, prefetch_one=True)
    assert KernelTuning.parse("1,0,1,1,0") == KernelTuning(True, False, True, True, fused_rows=False)
    for bad in ("fast", "1", "1,0,1,1,0,1", "1,2"):
        with pytest.raises(ValueError, match="PREFETCH,PAIR_AS_TRIPLE"):
            KernelTuning.parse(bad)


def test_one_rows_prefetch_is_its_own_decision_and_a_tie_keeps_it_off():
    off = KernelTuning(prefetch=False, pair_as_triple=False)
    on = replace(off, prefetch_one=True)
    assert pick_one_row({off: {1: 1.0}, on: {1: 1.0}}) == off
    assert pick_one_row({off: {1: 1.0}, on: {1: 0.8}}) == on
    assert pick_one_row({on: {1: 0.8}, off: {1: 0.7}}) == off


def test_fused_rows_is_judged_over_the_rows_it_serves_and_a_tie_keeps_it():
    on = KernelTuning(prefetch=True, pair_as_triple=False, fma_rows=True, prefetch_one=True)
    off = replace(on, fused_rows=False)
    assert gguf_tuning.pick_fused({on: {1: 1.0, 2: 1.0}, off: {1: 1.0, 2: 1.0}}) == on
    assert gguf_tuning.pick_fused({on: {1: 0.9, 2: 1.3}, off: {1: 1.0, 2: 1.0}}) == off  # faster at 1, slower summed


class FakeKernel:
    """Records set_tuning; several rows are slow under prefetch, one row is slow without prefetch_one, any row under
    fused_rows (so timing picks prefetch off, prefetch_one on and fused_rows off: each decided apart)."""

    def __init__(self):
        self.calls, self.prefetch, self.prefetch_one, self.fused_rows = [], True, False, True

    def set_tuning(self, prefetch, pair, fma_rows=False, prefetch_one=False, fused_rows=True):
        assert not fma_rows  # no fma_rows_exact: never offered
        self.calls.append((prefetch, pair, prefetch_one, fused_rows))
        self.prefetch, self.prefetch_one, self.fused_rows = prefetch, prefetch_one, fused_rows

    def linear(self, x, data, qtype, bias):
        if (self.prefetch if x.shape[0] > 1 else not self.prefetch_one):
            sum(range(20000))  # burn time: these settings lose
        if self.fused_rows:
            sum(range(20000))
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
    assert got.prefetch is False and got.prefetch_one is True and got.fused_rows is False
    files = list(tmp_path.glob("*.json"))
    record = json.loads(files[0].read_text())
    assert len(files) == 1 and record["choice"] == {
        "prefetch": False, "pair_as_triple": got.pair_as_triple, "fma_rows": False, "prefetch_one": True,
        "fused_rows": False}
    assert {1, 2, 3, 4, 6} <= {int(r) for t in record["timed"] for r in t["ms_by_rows"]}
    fake2 = FakeKernel()
    assert tune_block_kernel(model, tmp_path, kernel=fake2) == got
    assert fake2.calls == [(got.prefetch, got.pair_as_triple, True, False)]  # no timing: one call, the cached choice
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


@needs_bf16
@pytest.mark.skipif(KERNEL is None or not gguf_tuning.fma_exact(KERNEL), reason="VDPBF16PS is not two FMAs here")
def test_bf16_exact_prefill_reads_the_blocks_only_under_fma_rows():
    """Prefill's projections (exact mode, a row floor rather than DecodeFloors) take the block kernel where it runs
    several rows in FMAs, oneDNN's GEMM otherwise."""
    from eyas.models import exact

    lin = layer("Q8_0", 64, 576, bias=True, seed=7)
    blocks = lin.__dict__["_eyas_blocks"]
    x = torch.randn(1, 24, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        gguf_tuning.apply(KERNEL, FMA_SETTINGS[0])
        assert gguf_tuning.prefill_on_blocks()
        assert torch.equal(exact.linear(lin, x, lambda m: 1), blocks.linear(x, lin.bias))
        gguf_tuning.apply(KERNEL, KernelTuning())
        assert not gguf_tuning.prefill_on_blocks()
        assert torch.equal(exact.linear(lin, x, lambda m: 1), lin.dense(x))


@needs_bf16
def test_in_use_names_the_choice_only_where_a_bf16_model_reads_blocks(monkeypatch):
    """What `eyas bench speed` records as settings.kernel_tuning."""
    chosen = KernelTuning(prefetch=False, pair_as_triple=False, prefetch_one=True)
    monkeypatch.setattr(gguf_tuning, "_active", chosen)
    model = nn.Sequential(layer("Q8_0", 64, 576))
    model.dtype = torch.bfloat16
    assert gguf_tuning.in_use(model) == chosen
    model.dtype = torch.float32  # a float32 target's blocks run on the float32 kernel, which has no such options
    assert gguf_tuning.in_use(model) is None
    dense = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    dense.dtype = torch.bfloat16
    assert gguf_tuning.in_use(dense) is None
