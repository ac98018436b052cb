"""float32 projections read from GGUF blocks (eyas/kernels/gguf_f32.cpp), the path of CPUs without native bf16.

The kernel must rebuild exactly the float32 weights eyas's loader makes from the same file (gguf-py's
dequantisation), and sum exactly as the few-row streaming kernel (skinny_gemm.cpp) does on those dense weights:
it replaces that kernel where it serves, so no output of a float32 target may change by a bit. Past the streaming
kernel's rows, and in training, the dense weight serves as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from eyas import kernels
from eyas.models import gguf_blocks
from eyas.models.gguf_blocks import GGUFBlocks
from eyas.models.packed import pack_linears_, skinny_rows
from tests.conftest import GGUF_TYPES, random_blocks, spy_target_block_rows

gguf = pytest.importorskip("gguf")
KERNEL = kernels.gguf_f32()
SKINNY = kernels.skinny_gemm()
pytestmark = pytest.mark.skipif(KERNEL is None or SKINNY is None or not KERNEL.available(),
                                reason="no C++ toolchain, or a CPU without AVX2/FMA/F16C")
TYPES = {name: ggml_id for name, (ggml_id, _) in GGUF_TYPES.items()}
NONE = torch.empty(0)


MANY_ROWS = 130  # a prefill chunk and more (the AVX-512 build takes any number of rows)


def streaming(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The streaming kernel's outputs for any number of rows: it is row-invariant, so in slices it takes."""
    step = SKINNY.max_rows()
    return torch.cat([SKINNY.linear(x[i : i + step], weight, bias) for i in range(0, x.shape[0], step)])


def blocks_and_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (model-sized fp16 scales and minimums) and the loader's float32 weight from them."""
    raw = random_blocks(qtype, n, k, seed)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(raw), torch.from_numpy(np.ascontiguousarray(deq)).reshape(n, k)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_gives_the_loaders_float32_weights_bit_for_bit(qtype):
    raw, weight = blocks_and_weight(qtype, 40, 1536)
    assert weight.dtype == torch.float32
    assert torch.equal(KERNEL.dequantize(raw, TYPES[qtype], 1536).view(torch.int32), weight.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES)
# 37, 6, 10 rows: short groups; K 1312: uneven slices (the AVX-512 many-row path)
@pytest.mark.parametrize("n,k", [(96, 576), (37, 1536), (6, 32), (10, 1312)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_the_streaming_kernel_on_the_dense_weight_bit_for_bit(qtype, n, k, threads):
    raw, weight = blocks_and_weight(qtype, n, k, seed=n)
    torch.manual_seed(k)
    x, bias = torch.randn(MANY_ROWS, k), torch.randn(n)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # every pass shape (AVX-512: 1-8 rows rebuilt in registers, passes of 8 to 16, past that passes of 1-6 rows
        # against 8 weight rows buffered, K in slices; AVX2: 1-8 rows in registers, past that the buffer of 4 weight
        # rows) and row invariance across them
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 18, 19, 21, 23, 24, 32, 33, 47, MANY_ROWS):
            if m > KERNEL.max_rows():
                continue
            for b in (NONE, bias):
                got, want = KERNEL.linear(x[:m], raw, TYPES[qtype], b), streaming(x[:m], weight, b)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (m, b.numel())
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("qtype", TYPES)
def test_extreme_fp16_scales_rebuild_as_gguf_py_does(qtype):
    """Scales and minimums at fp16's edges (subnormal, zero, the largest finite, both signs): the kernel rebuilds
    Q4_1's d * q + m with one fused multiply-add, which equals multiply-then-add only because d * q is exact in
    float32; these cases would show where it is not. Checked through dequantize's weights and linear's sums."""
    n, k = 8, 256
    raw = random_blocks(qtype, n, k, seed=3).reshape(n, k // 32, -1)
    edge = np.array([6e-8, -6e-8, 3e-5, 0.0, -0.0, 65504.0, -65504.0, 1e-3], dtype=np.float16)  # 2 subnormals first
    rng = np.random.default_rng(4)
    raw[..., 0:2] = rng.choice(edge, size=(n, k // 32)).view(np.uint8).reshape(n, k // 32, 2)
    if qtype == "Q4_1":
        raw[..., 2:4] = rng.choice(edge, size=(n, k // 32)).view(np.uint8).reshape(n, k // 32, 2)
    raw = raw.reshape(n, -1)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])  # the loader's float32 weights
    raw, weight = torch.from_numpy(raw.copy()), torch.from_numpy(np.ascontiguousarray(deq)).reshape(n, k)
    assert torch.equal(KERNEL.dequantize(raw, TYPES[qtype], k).view(torch.int32), weight.view(torch.int32))
    x = torch.randn(9, k) * 1e-3  # small inputs: 65504-sized weights stay finite in the sums
    for m in (1, 5, 9):
        got, want = KERNEL.linear(x[:m], raw, TYPES[qtype], NONE), SKINNY.linear(x[:m], weight, NONE)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), m


@pytest.mark.parametrize("qtype", TYPES)
def test_no_rows_give_an_empty_output(qtype):
    """An empty batch (training's features over a batch of no positions) reads nothing: 3211a14's AVX2 register path
    ran its one-row pass on zero rows and read past the empty input (a segfault in tests/train/test_grow_vocab.py)."""
    raw, _ = blocks_and_weight(qtype, 37, 576, seed=3)
    for bias in (NONE, torch.randn(37)):
        out = KERNEL.linear(torch.randn(0, 576), raw, TYPES[qtype], bias)
        assert out.shape == (0, 37) and out.dtype == torch.float32


def test_bad_input_is_named():
    raw, _ = blocks_and_weight("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="float32"):
        KERNEL.linear(torch.randn(2, 64).double(), raw, 8, NONE)
    if KERNEL.max_rows() < MANY_ROWS:  # without AVX-512 past 32 rows the dense GEMM serves
        with pytest.raises(RuntimeError, match="at most"):
            KERNEL.linear(torch.randn(KERNEL.max_rows() + 1, 64), raw, 8, NONE)
    with pytest.raises(RuntimeError, match="blocks \\[N, K / 32"):
        KERNEL.linear(torch.randn(2, 96), raw, 8, NONE)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        KERNEL.linear(torch.randn(2, 64), raw, 6, NONE)


def test_a_packed_float32_linear_reads_its_blocks_where_a_kernel_serves():
    raw, weight = blocks_and_weight("Q4_1", 64, 576)
    lin = nn.Linear(576, 64, bias=True).requires_grad_(False)
    lin.weight.copy_(weight)
    pack_linears_(lin)
    calls = []

    class Spy(GGUFBlocks):
        def linear(self, x, bias):
            calls.append(x.shape)
            return super().linear(x, bias)

    lin.__dict__["_eyas_blocks"] = Spy(data=raw, qtype=TYPES["Q4_1"], k=576)
    few, many = torch.randn(3, 576), torch.randn(skinny_rows(lin.weight) + 1, 576)
    with torch.inference_mode():
        out = lin(few)
        assert calls == [(3, 576)] and torch.equal(out, SKINNY.linear(few, weight, lin.bias))
        out = lin(many)  # past the streaming kernel's rows: the blocks where their kernel takes any count, else MKL
        if gguf_blocks.f32_any_rows():
            assert calls == [(3, 576), many.shape] and torch.equal(out, streaming(many, weight, lin.bias))
        else:
            assert calls == [(3, 576)]
    calls.clear()
    x = few.clone().requires_grad_(True)
    lin(x)  # autograd: the dense weight
    assert calls == []


# ---- the embedded default in float32 ------------------------------------------------------------------------------


def test_embedded_default_float32_attaches_every_projection(default_target, monkeypatch):
    from eyas.models.loading import embedded_gguf_path

    model = default_target.model
    assert model.dtype == torch.float32
    with_blocks = [m for m in model.modules() if "_eyas_blocks" in m.__dict__]
    assert len(with_blocks) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    down = model.model.layers[2].mlp.down_proj
    assert torch.equal(KERNEL.dequantize(down._eyas_blocks.data, down._eyas_blocks.qtype, down.in_features),
                       down.weight)
    monkeypatch.setenv("EYAS_GGUF_BLOCKS", "0")
    assert gguf_blocks.attach_gguf_blocks(model, embedded_gguf_path()) == 0


@pytest.mark.parametrize("exact", [False, True])
def test_embedded_default_float32_speculative_equals_plain_on_the_blocks(default_target, exact, monkeypatch):
    """Plain decoding and tree verification both read the blocks (in exact mode too, unpadded: the kernel is
    row-invariant; with the AVX-512 build the prompt's projections as well); the output is plain decoding's,
    token for token, and here the same tokens as with the blocks switched off (the dense weights)."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    loaded = default_target
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,10"), exact=exact)
    rows = spy_target_block_rows(monkeypatch, loaded.model)  # the target's projections (not the head's Q8_0 blocks)
    prompt = "List three facts about the moon, one per line."
    plain = spec.generate(prompt, speculate=False, max_new_tokens=40)
    prompt_rows = {spec.encode(prompt).shape[0]} if gguf_blocks.f32_any_rows() else set()  # the prompt's prefill
    assert 1 in rows and set(rows) - prompt_rows == {1}, "plain decoding did not read the blocks one row at a time"
    rows.clear()
    fast = spec.generate(prompt, max_new_tokens=40)
    assert fast.token_ids == plain.token_ids
    assert fast.steps < len(fast.token_ids) - 1, "nothing was accepted: the comparison proves little"
    assert max(rows) > 1, "verification never ran a tree through the blocks"
    monkeypatch.undo()
    held = {m: m.__dict__.pop("_eyas_blocks") for m in loaded.model.modules() if "_eyas_blocks" in m.__dict__}
    try:
        dense = spec.generate(prompt, speculate=False, max_new_tokens=40)
    finally:
        for m, b in held.items():
            m.__dict__["_eyas_blocks"] = b
    assert dense.token_ids == plain.token_ids


def test_exact_prefill_reads_the_blocks_and_fills_the_same_cache_in_any_chunking(default_target, monkeypatch):
    """Exact prefill must give the cache the same bits whatever the chunks. With the AVX-512 build the block kernel
    takes any number of rows, so every projection reads the blocks with its chunk's rows, unpadded (row-invariant);
    without it the cache's projections pad on the dense GEMM and only a chunk's logit row, the last token's, reads
    the blocks. Either way the logits are the kernel's on the final hidden row, bit for bit, and the cache and the
    first token are the same in one chunk of 45 rows and in chunks of 16, 16 and 13."""
    from eyas.decode import DecodeConfig, SpecDecoder, next_span, prefill_spans
    from eyas.models.base import ForwardOutput

    model = default_target.model
    blocks = model.lm_head_proj.__dict__["_eyas_blocks"]
    t = 45
    prompt = torch.randint(0, model.config.vocab_size, (t,), generator=torch.Generator().manual_seed(5))
    outs: list[ForwardOutput] = []
    run = model.run
    monkeypatch.setattr(model, "run", lambda *a: (outs.append(run(*a)), outs[-1])[1])
    rows = spy_target_block_rows(monkeypatch, model)
    firsts, caches = [], []
    for chunk in (128, 16):
        spans = prefill_spans(t, chunk)
        outs.clear()
        rows.clear()
        dec = SpecDecoder(model, None, DecodeConfig(max_new_tokens=2, exact=True))
        *_, seq = dec.prefill_steps(prompt, next_end=lambda s, t, c=chunk: next_span(s, t, c))
        if gguf_blocks.f32_any_rows():
            per_chunk = 4 * model.config.num_layers  # qkv, o, gate_up, down a layer, then the logit row
            assert rows == [n for s, e in spans for n in [e - s] * per_chunk + [1]]
        else:
            assert rows == [1] * len(outs), "only a chunk's logit row reads the blocks (the cache's projections pad)"
        last = outs[-1]
        assert torch.equal(last.logits[0, 0], blocks.linear(last.hidden[0, -1:], None)[0])
        firsts.append(seq.history[-1].item())
        caches.append((seq.cache.k[..., :t, :].clone(), seq.cache.v[..., :t, :].clone()))
    assert firsts[0] == firsts[1]
    for one, chunked in zip(caches[0], caches[1], strict=True):
        assert torch.equal(one, chunked)


def test_exact_mode_is_the_float32_default_only_where_every_projection_reads_blocks(default_target, tiny):
    """In float32 exact mode is on by default where it is the faster mode: every projection on the row-invariant
    block kernel, the compiled tree attention and layer step there; a dense float32 model stays in fast mode."""
    from eyas import kernels
    from eyas.models.exact import exact_by_default

    model = default_target.model
    ready = model.path_kernel() is not None and kernels.LAYER_OPS() is not None
    assert exact_by_default(model) == ready
    down = model.model.layers[3].mlp.down_proj
    held = down.__dict__.pop("_eyas_blocks")
    try:
        assert not exact_by_default(model)  # one projection on the dense weight: exact mode would pad it
    finally:
        down.__dict__["_eyas_blocks"] = held
    small = tiny.native("llama", seed=0)
    assert not exact_by_default(small)
    assert exact_by_default(small.to(torch.bfloat16))


def test_a_float32_heads_projections_become_q8_0_blocks_with_matching_dense_weights(monkeypatch):
    head = nn.Sequential(nn.Linear(576, 96, bias=False), nn.Linear(96, 64, bias=True), nn.Linear(40, 8))
    head = head.requires_grad_(False)
    pack_linears_(head)
    monkeypatch.setenv("EYAS_HEAD_INT8", "0")  # Q8_0 everywhere (else int8 rows where VNNI serves: test below)
    before = head[0].weight.clone()
    monkeypatch.setenv("EYAS_HEAD_Q8", "0")
    assert gguf_blocks.quantize_head_(head) == 0
    monkeypatch.delenv("EYAS_HEAD_Q8")
    assert gguf_blocks.quantize_head_(head) == 2  # K = 40 is not a multiple of 32: left as it is
    for lin in head[:2]:
        blocks = lin.__dict__["_eyas_blocks"]
        assert blocks.qtype == 8 and lin.weight.dtype == torch.float32
        assert torch.equal(KERNEL.dequantize(blocks.data, 8, lin.in_features), lin.weight)  # both paths: one weight
    assert (head[0].weight - before).abs().max() <= before.abs().max() / 127
    x = torch.randn(3, 576)
    with torch.inference_mode():  # the blocks at a few rows give the streaming kernel's bits on the same weight
        assert torch.equal(head[0](x), SKINNY.linear(x, head[0].weight, NONE))


def test_a_float32_heads_projections_become_int8_rows_where_the_kernel_serves_except_fc():
    """The int8 head kernel (eyas.models.int8_rows) takes every projection whose K is a multiple of 64 but the fused
    taps ``fc``; its dense weight becomes the int8 rows' values, so the torch path past the kernel's rows agrees."""
    from eyas.models.int8_rows import Int8Rows, int8_head_ready

    if not int8_head_ready(torch.float32):
        pytest.skip("needs the int8 head kernel (AVX2 or AVX512-VNNI)")
    head = nn.Module()
    head.fc, head.proj, head.odd = nn.Linear(192, 64, bias=False), nn.Linear(128, 64, bias=False), nn.Linear(96, 8)
    head = head.requires_grad_(False)
    pack_linears_(head)
    assert gguf_blocks.quantize_head_(head) == 3
    assert isinstance(head.fc._eyas_blocks, gguf_blocks.GGUFBlocks)  # fc: Q8_0 (int8 rows lose top-1 there)
    assert isinstance(head.odd._eyas_blocks, gguf_blocks.GGUFBlocks)  # K = 96: not a multiple of 64
    rows = head.proj._eyas_blocks
    assert isinstance(rows, Int8Rows) and torch.equal(rows.dequantize(), head.proj.weight)
    x = torch.randn(3, 128)
    with torch.inference_mode():
        assert torch.equal(head.proj(x), rows.linear(x, None))  # a few rows: the int8 kernel
        many = torch.randn(40, 128)  # past the kernel's rows: the dense weight, close to the kernel
        torch.testing.assert_close(head.proj(many)[:3], rows.linear(many[:3], None), rtol=0.05, atol=0.05)
