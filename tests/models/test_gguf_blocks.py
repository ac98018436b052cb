"""bf16 projections read from GGUF blocks (eyas/kernels/gguf_bf16.cpp, eyas.models.gguf_blocks).

The kernel must compute with exactly the weights eyas's loader makes from the same file (gguf-py's
dequantisation in float32, rounded to bf16), give every row the same bits whatever rows share the call
(exact mode runs decoding on it unpadded), and be chosen only where it should: few bf16 rows in fast
mode, every decode/verify forward in exact mode, never exact-mode prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas import kernels
from eyas.models import gguf_blocks
from eyas.models.exact import DecodeFloors, RowFloor, linear
from eyas.models.gguf_blocks import FAST_ROWS, GGUFBlocks
from eyas.models.packed import pack_linears_
from tests.conftest import GGUF_TYPES, random_blocks, spy_target_block_rows

gguf = pytest.importorskip("gguf")
KERNEL = kernels.gguf_bf16()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for eyas/kernels/gguf_bf16.cpp")
needs_bf16 = pytest.mark.skipif(KERNEL is None or not KERNEL.available(), reason="CPU without AVX512-BF16")
TYPES = GGUF_TYPES


def gguf_py_bf16(raw: np.ndarray, qtype: str, k: int) -> torch.Tensor:
    """The loader's weights: gguf-py's float32 dequantisation, then torch's rounding to bf16."""
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(deq)).reshape(raw.shape[0], k).to(torch.bfloat16)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_gives_the_loaders_bf16_weights_bit_for_bit(qtype):
    raw = random_blocks(qtype, 48, 576)
    got = KERNEL.dequantize(torch.from_numpy(raw), TYPES[qtype][0], 576)
    assert torch.equal(got.view(torch.int16), gguf_py_bf16(raw, qtype, 576).view(torch.int16))


def layer(qtype: str, n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    """A PackedLinear holding the dequantised weight, with its blocks attached as attach_gguf_blocks does."""
    raw = random_blocks(qtype, n, k, seed)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16).requires_grad_(False)
    lin.weight.copy_(gguf_py_bf16(raw, qtype, k))
    pack_linears_(lin)
    lin.__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.from_numpy(raw), qtype=TYPES[qtype][0], k=k)
    return lin


@needs_bf16
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_row_invariant_and_computes_with_the_weights(qtype, bias):
    lin = layer(qtype, 200, 1536 if qtype == "Q8_0" else 576, bias)
    blocks = lin.__dict__["_eyas_blocks"]
    x = torch.randn(40, lin.in_features).to(torch.bfloat16)
    full = blocks.linear(x, lin.bias)
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 10, 16, 33):  # a row's bits never depend on what shares the call
        parts = torch.cat([blocks.linear(x[i : i + m], lin.bias) for i in range(0, 40, m)])
        assert torch.equal(parts.view(torch.int16), full.view(torch.int16)), m
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    torch.testing.assert_close(full.float(), ref, rtol=1e-2, atol=2e-2)  # bf16 output rounding only


@needs_bf16
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [32, 576, 1536])  # 1, 18 and 48 blocks: a row's scales in 16s with a tail, or none
def test_the_packed_q4_layout_gives_the_gguf_layouts_bits(qtype, k):
    """The bf16 kernel's packed layout (nibbles, then scales) is the same bytes regrouped: every output of every row
    count, bias included, equal to the GGUF layout's, and GGUFBlocks.linear reads the packed one (made once)."""
    raw = torch.from_numpy(random_blocks(qtype, 37, k, seed=k))
    code = TYPES[qtype][0]
    packed = KERNEL.pack(raw, code, k)
    assert packed.shape == raw.shape and not torch.equal(packed, raw)
    nblk, size = k // 32, raw.shape[1] // (k // 32)
    scales = raw.view(37, nblk, size)[:, :, :2].reshape(37, -1)  # every block's d, then the nibbles apart
    assert torch.equal(packed[:, 16 * nblk : 18 * nblk], scales)
    x = (4 * torch.randn(9, k, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    bias = torch.randn(37).to(torch.bfloat16)
    for m in range(1, 10):
        for b in (torch.empty(0), bias):
            want = KERNEL.linear(x[:m], raw, code, b)
            got = KERNEL.linear(x[:m], packed, KERNEL.packed_type() + code, b)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, b.numel())
    blocks = GGUFBlocks(data=raw, qtype=code, k=k)
    data, got_code = blocks.operands(torch.bfloat16)
    assert torch.equal(data, packed) and got_code == KERNEL.packed_type() + code
    assert blocks.operands(torch.bfloat16)[0] is data  # packed once
    assert blocks.operands(torch.float32) == (raw, code)  # the float32 kernel reads the GGUF layout
    assert torch.equal(blocks.linear(x, None).view(torch.int16), KERNEL.linear(x, raw, code, torch.empty(0)).view(
        torch.int16))


def test_pack_refuses_what_it_cannot_pack():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(RuntimeError, match="Q4_0 or Q4_1"):
        KERNEL.pack(raw, 8, 64)
    with pytest.raises(RuntimeError, match="blocks \\[N, K / 32"):
        KERNEL.pack(torch.zeros(4, 41, dtype=torch.uint8), 3, 64)


@needs_bf16
@pytest.mark.parametrize("n", [8, 9])  # whole groups of 4 (the vector rounding) and a last group of 1 (c10's)
def test_output_rounding_is_torchs_for_ties_nan_and_inf(n):
    """Sums exact in float32 (integers) that bf16 must round: ties to even, NaN as 0x7FC0, infinities kept."""
    d = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw = np.zeros((n, 34), dtype=np.uint8)  # Q8_0, one block a row: w[j] = (1, q_j, 0, ...)
    raw[:, 0:2] = d
    raw[:, 2] = 1
    q = np.array([1, 3, 5, -3, 127, -127, 0, 2, 7][:n], dtype=np.int8)
    raw[:, 3] = q.view(np.uint8)
    raw[6, 2] = 0  # row 6 weighs x0 by zero: inf * 0 = NaN
    x = torch.zeros(4, 32)
    x[:, 1] = 1.0
    x[:, 0] = torch.tensor([256.0, 512.0, float("inf"), float("nan")])
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 0][:n], dtype=torch.float32).to(torch.bfloat16)
    got = KERNEL.linear(x.to(torch.bfloat16), torch.from_numpy(raw), TYPES["Q8_0"][0], bias)
    w = torch.zeros(n, 32)
    w[:, 0], w[:, 1] = torch.from_numpy(raw[:, 2].astype(np.float32)), torch.from_numpy(q.astype(np.float32))
    exact = x[:, :2] @ w[:, :2].T + bias.float()  # exact sums
    want = exact.to(torch.bfloat16).view(torch.int16)  # torch's rounding; a NaN is 0x7FC0, as c10::BFloat16(float)
    want = torch.where(exact.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), want)
    assert torch.equal(got.view(torch.int16), want), (got, exact)
    assert got[0, 0] == 256 and got[0, 1] == 260 and got[3].view(torch.int16).eq(0x7FC0).all()  # 257 -> 256, 259 -> 260


@needs_bf16
def test_dispatch_fast_mode_exact_decoding_and_exact_prefill(tmp_path):
    lin = layer("Q4_1", 64, 576)
    blocks = lin.__dict__["_eyas_blocks"]
    floors = RowFloor(store=tmp_path / "floors.json")
    with torch.inference_mode():
        few = torch.randn(1, FAST_ROWS, 576).to(torch.bfloat16)
        many = torch.randn(1, FAST_ROWS + 1, 576).to(torch.bfloat16)
        assert torch.equal(lin(few), blocks.linear(few, None))  # fast mode: the kernel for a few rows
        assert torch.equal(lin(many), lin.dense(many))  # ... and oneDNN past FAST_ROWS
        assert torch.equal(linear(lin, many, DecodeFloors(floors)), blocks.linear(many, None))  # exact decoding
        assert torch.equal(linear(lin, few, floors), lin.dense(few))  # exact prefill: never the kernel
    assert floors(lin) == RowFloor(store=tmp_path / "other.json")(nn.Linear(576, 64).to(torch.bfloat16))


@needs_bf16
def test_training_and_other_dtypes_do_not_take_the_kernel():
    lin = layer("Q8_0", 32, 576)
    x = torch.randn(2, 576).to(torch.bfloat16).requires_grad_(True)
    assert gguf_blocks.blocks_of(lin, x) is None
    assert gguf_blocks.blocks_of(lin, torch.randn(2, 576)) is None
    assert gguf_blocks.blocks_of(lin, x.detach()) is not None


# ---- the embedded default (its GGUF file is Q4_1 + a Q8_0 embedding) ----------------------------------


@needs_bf16
def test_embedded_default_attaches_every_projection_and_checks_them(embedded_bf16, monkeypatch):
    loaded, path = embedded_bf16
    model = loaded.model
    with_blocks = [m for m in model.modules() if "_eyas_blocks" in m.__dict__]
    assert len(with_blocks) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(KERNEL.dequantize(qkv._eyas_blocks.data, qkv._eyas_blocks.qtype, 576), qkv.weight)
    monkeypatch.setenv("EYAS_GGUF_BLOCKS", "0")
    assert gguf_blocks.attach_gguf_blocks(model, path) == 0


@needs_bf16
def test_a_block_that_does_not_give_the_weight_is_not_attached(embedded_bf16):
    loaded, path = embedded_bf16
    model = loaded.model
    down = model.model.layers[1].mlp.down_proj
    saved = down.__dict__.pop("_eyas_blocks")
    try:
        down.weight.data[3, 5] += 1.0  # the loaded weight no longer is what the file's blocks give
        count = gguf_blocks.attach_gguf_blocks(model, path)
        assert count == 4 * model.config.num_layers and "_eyas_blocks" not in down.__dict__
    finally:
        down.weight.data[3, 5] -= 1.0
        down.__dict__["_eyas_blocks"] = saved
        gguf_blocks.attach_gguf_blocks(model, path)


@needs_bf16
def test_embedded_default_bf16_speculative_equals_drafter_none_on_the_blocks(embedded_bf16, monkeypatch):
    """Exact mode's promise with the kernel serving every decode and verify forward, unpadded."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    loaded, _ = embedded_bf16
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,10"))
    assert spec.exact
    rows = spy_target_block_rows(monkeypatch, loaded.model)  # the target's projections (not the head's Q8_0 blocks)
    prompt = "List three facts about the moon, one per line."
    plain = spec.generate(prompt, speculate=False, max_new_tokens=40)
    assert rows, "plain bf16 decoding never read the GGUF blocks"
    rows.clear()
    fast = spec.generate(prompt, max_new_tokens=40)
    assert fast.token_ids == plain.token_ids
    assert fast.steps < len(fast.token_ids) - 1, "nothing was accepted: the comparison proves little"
    assert max(rows) > 1, "verification never ran a tree through the kernel"


def test_q8_0_quantisation_is_ggml_q8_0_within_half_a_step():
    w = torch.randn(40, 576, generator=torch.Generator().manual_seed(3)) * 0.05
    w[3, :32] = 0.0  # an all-zero block: scale 0, quants 0
    raw = gguf_blocks.quantize_q8_0(w)
    assert raw.shape == (40, 576 // 32 * 34) and raw.dtype == torch.uint8
    deq = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q8_0)).reshape(40, 576)
    step = w.reshape(40, -1, 32).abs().amax(-1, keepdim=True) / 127  # one quantisation step per block
    err = (deq.reshape(40, -1, 32) - w.reshape(40, -1, 32)).abs()
    assert bool((err <= 0.5 * step * 1.01 + 1e-8).all())
    assert torch.count_nonzero(deq[3, :32]) == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_blocks.quantize_q8_0(torch.zeros(2, 40))


@needs_bf16
def test_a_heads_projections_become_q8_0_blocks_with_matching_dense_weights(monkeypatch):
    head = nn.Sequential(nn.Linear(576, 96, bias=False), nn.Linear(96, 64, bias=True), nn.Linear(40, 8))
    head = head.to(torch.bfloat16).requires_grad_(False)
    pack_linears_(head)
    before = head[0].weight.clone()
    monkeypatch.setenv("EYAS_HEAD_INT8", "0")  # Q8_0 blocks (else int8 rows where they pay: test_int8_rows)
    monkeypatch.setenv("EYAS_HEAD_Q8", "0")
    assert gguf_blocks.quantize_head_(head) == 0
    monkeypatch.delenv("EYAS_HEAD_Q8")
    assert gguf_blocks.quantize_head_(head) == 2  # K = 40 is not a multiple of 32: left as it is
    assert "_eyas_blocks" not in head[2].__dict__
    for lin in head[:2]:
        blocks = lin.__dict__["_eyas_blocks"]
        assert blocks.qtype == 8
        assert torch.equal(KERNEL.dequantize(blocks.data, 8, lin.in_features), lin.weight)  # both paths: one weight
    assert not torch.equal(head[0].weight, before)
    assert (head[0].weight.float() - before.float()).abs().max() <= before.float().abs().max() / 127
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        few, dense = head[0](x), head[0].dense(x)  # block kernel (<= FAST_ROWS rows) vs oneDNN, same weight
    torch.testing.assert_close(few, dense, rtol=1e-2, atol=1e-2)
