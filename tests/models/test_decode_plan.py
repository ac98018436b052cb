"""The layers' kernel calls gathered once (eyas.models.decode_plan): the modules' bits, where it serves only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models import gguf_tuning
from eyas.models.attention import AttnMeta
from eyas.models.base import PathAttention
from eyas.models.decode_plan import DecodePlan, NativeStep, layer_caches
from eyas.models.gguf_blocks import F32_ROWS, block_kernel, block_kernel_for

needs_blocks = pytest.mark.skipif(block_kernel() is None, reason="needs AVX512-BF16 (the bf16 block kernel of a plan)")
needs_f32_blocks = pytest.mark.skipif(block_kernel_for(torch.float32) is None,
                                      reason="needs AVX2, FMA and F16C (the float32 block kernel of a plan)")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_forwards(a: list[tuple], b: list[tuple]) -> None:
    """Two generations' forwards (``generate_recorded``'s): the same tokens, and logits, hidden states and taps to the
    bit."""
    for (t1, l1, h1, taps1), (t2, l2, h2, taps2) in zip(a, b, strict=True):
        assert torch.equal(t1, t2) and same_bits(l1, l2) and same_bits(h1, h2)
        assert taps1.keys() == taps2.keys() and all(same_bits(taps1[i], taps2[i]) for i in taps1)


def generate_recorded(monkeypatch, spec, plan, speculate: bool) -> tuple[list[int], list[tuple], int]:
    """(token ids, every forward's (tokens, logits, hidden, taps) copied, plan runs) of one generation with the
    target's plan set to ``plan`` (None: through the modules)."""
    model = spec.target.model
    seen, served = [], []
    real_run, real_plan = type(model).run, DecodePlan.run

    def spy(self, tokens, positions, cache, meta):
        out = real_run(self, tokens, positions, cache, meta)
        taps = {i: t.clone() for i, t in out.taps.items()}
        seen.append((tokens.clone(), out.logits.clone(), out.hidden.clone(), taps))
        return out

    with monkeypatch.context() as m:
        m.setitem(model.__dict__, "_decode_plan", plan)
        m.setattr(type(model), "run", spy)
        m.setattr(DecodePlan, "run", lambda self, *a: served.append(1) or real_plan(self, *a))
        result = spec.generate("Write a haiku about a heron at dawn.", speculate=speculate, max_new_tokens=40)
    return result.token_ids, seen, len(served)


@pytest.fixture(params=["bfloat16", "float32"])
def embedded_exact(request):
    """The embedded default in exact mode, in each dtype whose block kernel this CPU builds (loaded only then)."""
    if request.param == "bfloat16":
        if block_kernel() is None:
            pytest.skip("needs AVX512-BF16 (the bf16 block kernel of a plan)")
        return request.getfixturevalue("embedded_bf16")[0]
    if block_kernel_for(torch.float32) is None:
        pytest.skip("needs AVX2, FMA and F16C (the float32 block kernel of a plan)")
    return request.getfixturevalue("default_target")


@pytest.mark.parametrize("speculate", [False, True])
def test_the_plan_gives_every_forward_the_modules_bits(embedded_exact, monkeypatch, speculate):
    """Plain decoding and tree verification of the embedded default (exact mode, bf16 and float32): the same logits,
    final hidden states and EAGLE-3 taps in every forward, prefill included, with the plan as through the modules."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    loaded = embedded_exact
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,8"))
    plan = loaded.model.decode_plan()
    assert spec.exact and plan is not None
    ids_plan, fw_plan, served = generate_recorded(monkeypatch, spec, plan, speculate)
    ids_mod, fw_mod, unserved = generate_recorded(monkeypatch, spec, None, speculate)
    assert served >= len(fw_plan) - 1 and unserved == 0  # every decode / verify forward (prefill: the tuning's)
    assert ids_plan == ids_mod and len(fw_plan) == len(fw_mod) > 5
    if speculate:
        assert any(t.shape[1] > 1 for t, *_ in fw_plan[1:]), "no tree was verified"
    assert_same_forwards(fw_plan, fw_mod)


@needs_blocks
def test_the_plan_serves_one_sequence_on_the_path_kernel_only(embedded_bf16, monkeypatch):
    loaded, _ = embedded_bf16
    plan = loaded.model.decode_plan()
    kernel = loaded.model.path_kernel()
    assert plan is not None and kernel is not None

    def paths(n: int, kern=kernel) -> list[PathAttention]:
        order = torch.arange(n).expand(n, n)
        return [PathAttention(order=order, lengths=torch.arange(1, n + 1), start=0, kv_len=64, mirror=None,
                              kernel=kern)]

    tokens = torch.zeros(1, 3, dtype=torch.long)
    assert plan.serves(tokens, AttnMeta(start=0, kv_len=64, paths=paths(3)), exact_prefill=False)
    assert not plan.serves(tokens, AttnMeta(start=0, kv_len=64), exact_prefill=False)  # a mask, no paths
    assert not plan.serves(tokens, AttnMeta(start=0, kv_len=64, paths=paths(3, None)), exact_prefill=False)
    assert not plan.serves(torch.zeros(2, 3, dtype=torch.long), AttnMeta(start=0, kv_len=64, paths=paths(3) * 2),
                           exact_prefill=False)  # a batch
    assert not plan.serves(tokens, AttnMeta(start=0, kv_len=64, paths=paths(2)), exact_prefill=False)
    for blocks in (True, False):  # exact prefill: only where bf16 prefill reads the blocks, as exact.linear routes it
        monkeypatch.setattr(gguf_tuning, "prefill_on_blocks", lambda blocks=blocks: blocks)
        assert plan.serves(tokens, AttnMeta(start=0, kv_len=64, paths=paths(3)), exact_prefill=True) == blocks


@needs_blocks
def test_no_plan_without_every_piece_compiled(tiny, embedded_bf16, monkeypatch):
    assert DecodePlan.build(tiny.native("llama")) is None  # float32, no GGUF blocks
    loaded, _ = embedded_bf16
    monkeypatch.setenv("EYAS_DECODE_PLAN", "0")
    assert DecodePlan.build(loaded.model) is None
    monkeypatch.delenv("EYAS_DECODE_PLAN")
    layer = loaded.model.model.layers[3].mlp.down_proj
    monkeypatch.delitem(layer.__dict__, "_eyas_blocks")  # one projection on the dense path
    assert DecodePlan.build(loaded.model) is None


@needs_f32_blocks
def test_a_float32_plan_serves_the_forwards_the_block_kernel_takes(default_target, monkeypatch):
    """float32: decode and verify forwards of at most F32_ROWS rows (exact.linear's routing on AVX2); exact prefill
    and larger forwards only where the kernel's AVX-512 build takes any number of rows."""
    model = default_target.model
    plan, kernel = model.decode_plan(), model.path_kernel()
    assert plan is not None and plan.dtype == torch.float32 and kernel is not None

    def meta(n: int) -> AttnMeta:
        order = torch.arange(n).expand(n, n)
        pa = PathAttention(order=order, lengths=torch.arange(1, n + 1), start=0, kv_len=64, mirror=None, kernel=kernel)
        return AttnMeta(start=0, kv_len=64, paths=[pa])

    small, large = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, F32_ROWS + 1, dtype=torch.long)
    for any_rows in (True, False):
        monkeypatch.setattr("eyas.models.decode_plan.f32_any_rows", lambda any_rows=any_rows: any_rows)
        assert plan.serves(small, meta(3), exact_prefill=False)
        assert plan.serves(small, meta(3), exact_prefill=True) == any_rows
        assert plan.serves(large, meta(F32_ROWS + 1), exact_prefill=False) == any_rows


def test_layer_caches_are_each_layers_first_sequence_and_follow_a_replaced_tensor():
    cache = KVCache.empty(3, 2, 2, 16, 4, torch.float32)
    views = layer_caches(cache)
    assert layer_caches(cache) is views  # made once
    for i, (k, v) in enumerate(views):
        assert k.data_ptr() == cache.k[i, 0].data_ptr() and k.shape == cache.k[i, 0].shape
        assert v.data_ptr() == cache.v[i, 0].data_ptr() and v.shape == cache.v[i, 0].shape
    cache.k = torch.ones_like(cache.k)  # a cache whose tensors are replaced gets views of the new ones
    fresh = layer_caches(cache)
    assert fresh is not views and torch.equal(fresh[2][0], cache.k[2, 0])


# ---- the bf16 loop as one native call (eyas/kernels/decode_step.cpp) ----------------------------------------------

@pytest.mark.parametrize("speculate", [False, True])
def test_the_native_loop_gives_every_forward_the_python_loops_bits(embedded_bf16, monkeypatch, speculate):
    """bf16 exact mode, plain decoding and tree verification: the native call's logits, hidden states and EAGLE-3 taps
    equal the Python loop's in every forward, and it serves every forward the plan serves."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    loaded, _ = embedded_bf16
    plan = loaded.model.decode_plan()
    if plan is None or plan.native is None:
        pytest.skip("needs the bf16 block kernel and the decode_step kernel")
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,8"))
    calls, real = [], NativeStep.run
    with monkeypatch.context() as m:
        m.setattr(NativeStep, "run", lambda self, *a: calls.append(a[0].shape[1]) or real(self, *a))
        ids_native, fw_native, served = generate_recorded(monkeypatch, spec, plan, speculate)
    ids_py, fw_py, _ = generate_recorded(monkeypatch, spec, replace(plan, native=None), speculate)
    assert len(calls) == served and served >= len(fw_native) - 1
    assert ids_native == ids_py and len(fw_native) == len(fw_py) > 5
    if speculate:
        assert max(calls) > 1, "no tree was verified through the native call"
    assert_same_forwards(fw_native, fw_py)


@needs_blocks
def test_the_native_loop_is_bf16_only_and_has_a_switch(embedded_bf16, monkeypatch):
    loaded, _ = embedded_bf16
    plan = DecodePlan.build(loaded.model)
    assert plan is not None
    if plan.native is None:
        pytest.skip("the decode_step kernel is not built here")
    assert NativeStep.build(plan.layers, plan.heads, plan.kv_heads, plan.head_dim, torch.float32) is None
    monkeypatch.setenv("EYAS_DECODE_STEP", "0")  # kernels.decode_step() asks the switch before its loaded module
    off = DecodePlan.build(loaded.model)
    assert off is not None and off.native is None  # the Python loop, the same plan otherwise


@needs_blocks
def test_the_native_loops_block_kernel_takes_the_processs_tuning(embedded_bf16, monkeypatch):
    """The native call links its own copy of the block kernel: the tuning set on the block kernel reaches it too,
    whether the plan was built before the tuning or after."""
    loaded, _ = embedded_bf16
    plan = DecodePlan.build(loaded.model)
    if plan is None or plan.native is None:
        pytest.skip("the decode_step kernel is not built here")
    native, seen = kernels.loaded("decode_step"), []
    monkeypatch.setattr(native, "set_tuning", lambda *a: seen.append(a))
    before = gguf_tuning.active()
    other = gguf_tuning.KernelTuning(prefetch=not before.prefetch, pair_as_triple=before.pair_as_triple)
    try:
        gguf_tuning.apply(block_kernel(), other)
        assert seen and seen[-1][0] == other.prefetch
        seen.clear()
        DecodePlan.build(loaded.model)
        assert seen and seen[-1][0] == other.prefetch
    finally:
        gguf_tuning.apply(block_kernel(), before)


@needs_blocks
def test_the_native_loop_refuses_bad_input_with_the_reason(embedded_bf16):
    loaded, _ = embedded_bf16
    plan = DecodePlan.build(loaded.model)
    if plan is None or plan.native is None:
        pytest.skip("the decode_step kernel is not built here")
    step = plan.native.step
    x = torch.zeros(1, 576, dtype=torch.bfloat16)
    empty = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="one key and one value cache a layer"):
        step.run(x, x, x, [], [], 0, empty, empty, 0.125, [])
    with pytest.raises(RuntimeError, match=r"x \[N, D\] bfloat16"):
        step.run(x.float(), x, x, [x] * 30, [x] * 30, 0, empty, empty, 0.125, [])
    with pytest.raises(RuntimeError, match="norm weights"):
        type(step)([(x[0].float(), x[0], *[(torch.zeros(1, 18, dtype=torch.uint8), 8, empty)] * 4)], 1e-5, 9, 3, 64)
