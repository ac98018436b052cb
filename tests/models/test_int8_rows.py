"""The draft head's int8 projection (eyas/kernels/head_i8.cpp): its sums reproduced bit for bit in torch."""

from __future__ import annotations

import pytest
import torch

from eyas.models.int8_rows import Int8Rows, _kernel, set_prefetch_from_env

pytestmark = pytest.mark.skipif(_kernel() is None, reason="needs AVX2 and a C++ toolchain")


def reference(rows: Int8Rows, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's formula in torch: each row quantised to int8 (scale max |x| / 127, round half to even), exact
    integer dot products, then float(dot) * (sx * sw) and the bias added after.
    """
    x = x.float()
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127 / amax.clamp(min=1e-30), torch.zeros(()))
    xq = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int64)
    dot = (xq @ rows.data.to(torch.int64).T).to(torch.float32)
    y = dot * ((amax / 127)[:, None] * rows.scale[None, :])
    return y if bias is None else y + bias


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 12, 32])
@pytest.mark.parametrize("k,n", [(64, 9), (576, 960), (2304, 576)])
def test_matches_reference_bit_for_bit(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    rows = Int8Rows.quantize(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 5] = 40.0  # an outlier sets row 0's scale
    assert torch.equal(rows.linear(x, None), reference(rows, x, None))


def test_bias_bf16_zero_rows_and_shape():
    g = torch.Generator().manual_seed(1)
    rows = Int8Rows.quantize(torch.randn(10, 128, generator=g))
    bias = torch.randn(10, generator=g)
    x = torch.randn(2, 3, 128, generator=g)
    x[0, 1] = 0  # an all-zero row: output = bias
    out = rows.linear(x, bias)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out.reshape(6, 10), reference(rows, x.reshape(6, 128), bias))
    assert torch.equal(out[0, 1], bias)
    xb = x.to(torch.bfloat16)
    outb = rows.linear(xb, None)
    assert outb.dtype == torch.bfloat16
    assert torch.equal(outb.reshape(6, 10), reference(rows, xb.reshape(6, 128), None).to(torch.bfloat16))


def test_quantize_close_to_weights_and_cat():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 192, generator=g)
    rows = Int8Rows.quantize(w)
    err = (rows.dequantize() - w).abs().amax(dim=1)
    assert torch.all(err <= w.abs().amax(dim=1) / 254 * 1.0001)  # half a step of each row's scale
    a, b = Int8Rows.quantize(w[:6]), Int8Rows.quantize(w[6:])
    both = Int8Rows.cat([a, b])
    x = torch.randn(3, 192, generator=g)
    assert torch.equal(both.linear(x, None), torch.cat([a.linear(x, None), b.linear(x, None)], dim=1))
    # close to the float product: int8 weights and rows within ~1 % of the output's scale
    ref = x @ w.T
    assert (rows.linear(x, None) - ref).abs().max() < 0.02 * ref.abs().max()


def test_extreme_bytes_sum_exactly():
    """Weights of -128 and +-127 against rows at +-127 after rounding: the AVX2 body's byte pairs (|q| * x with q's
    sign, at most 2 * 128 * 127 in 16 bits) must not saturate, and it must give the VNNI formula's bits."""
    g = torch.Generator().manual_seed(4)
    data = torch.randint(-128, 128, (37, 256), generator=g, dtype=torch.int8)
    data[0] = -128
    data[1, ::2], data[1, 1::2] = -128, 127
    data[2] = 127
    rows = Int8Rows(data=data, scale=torch.rand(37, generator=g) * 0.01 + 1e-3, sums=data.sum(dim=1, dtype=torch.int32),
                    k=256)
    x = torch.randn(5, 256, generator=g)
    x[0] = 7.0  # every value rounds to +127
    x[1] = -7.0  # every value rounds to -127
    x[2, ::2], x[2, 1::2] = 3.0, -3.0
    assert torch.equal(rows.linear(x, None), reference(rows, x, None))


@pytest.mark.parametrize("m", [1, 3, 7])
def test_tiled_and_row_layouts_give_the_same_bits(m):
    """pack()'s tiles (AVX512-VNNI: each 4 rows' 64-byte chunks in turn, a short last group padded) and plain rows."""
    g = torch.Generator().manual_seed(5)
    rows = Int8Rows.quantize(torch.randn(1027, 576, generator=g) * 0.05)  # 257 groups, the last one short
    x = torch.randn(m, 576, generator=g)
    plain = Int8Rows(data=rows.data, scale=rows.scale, sums=rows.sums, k=576, tiled=False)
    want = reference(rows, x, None)
    assert torch.equal(plain.linear(x, None), want)
    if not _kernel().tiles():
        pytest.skip("the AVX2 body reads rows only")
    tiles = _kernel().pack(rows.data)
    assert tiles.shape == (1028, 576)
    assert torch.equal(tiles.view(257, 9, 4, 64)[:256].permute(0, 2, 1, 3).reshape(1024, 576), rows.data[:1024])
    assert torch.equal(tiles.view(257, 9, 4, 64)[256, :, 3], rows.data[1026].view(9, 64))  # padding: the last row
    tiled = Int8Rows(data=rows.data, scale=rows.scale, sums=rows.sums, k=576, tiled=True)
    assert torch.equal(tiled.linear(x, None), want)
    assert torch.equal(tiled.packed, tiles)
    with pytest.raises(RuntimeError, match="1028 expected"):
        _kernel().linear(x, rows.data, True, rows.scale, rows.sums, torch.empty(0))


def test_layout_is_chosen_when_the_rows_are_made(monkeypatch):
    """EYAS_HEAD_I8_TILES as it was at quantisation (when the prefetch distance is read too), not at the first call:
    a head loaded under one setting keeps it while another loads under the other (scripts/head_ab.py --later-env)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(8, 128, generator=g)
    monkeypatch.setenv("EYAS_HEAD_I8_TILES", "0")
    rows = Int8Rows.quantize(w)
    monkeypatch.delenv("EYAS_HEAD_I8_TILES")
    later = Int8Rows.quantize(w)
    x = torch.randn(2, 128, generator=g)
    assert torch.equal(rows.linear(x, None), later.linear(x, None))
    assert not rows.tiled and rows.packed.shape == (8, 128)
    assert later.tiled == _kernel().tiles()


@pytest.mark.parametrize("groups", [0, 1, 2, 64])
def test_prefetch_changes_no_bit(groups):
    """The software prefetch distance (0 off) leaves every sum as it is, short last group included."""
    g = torch.Generator().manual_seed(3)
    rows = Int8Rows.quantize(torch.randn(1027, 576, generator=g) * 0.05)  # 257 groups, the last one short
    x = torch.randn(5, 576, generator=g)
    try:
        _kernel().set_prefetch(groups)
        assert torch.equal(rows.linear(x, None), reference(rows, x, None))
    finally:
        set_prefetch_from_env()  # the default again


def test_prefetch_env(monkeypatch):
    monkeypatch.setenv("EYAS_HEAD_I8_PREFETCH", "4")
    assert set_prefetch_from_env() == 4
    for bad in ("-1", "x", "65"):
        monkeypatch.setenv("EYAS_HEAD_I8_PREFETCH", bad)
        with pytest.raises(ValueError, match="EYAS_HEAD_I8_PREFETCH"):
            set_prefetch_from_env()
    monkeypatch.delenv("EYAS_HEAD_I8_PREFETCH")
    monkeypatch.delenv("EYAS_HEAD_I8_TILES", raising=False)
    assert set_prefetch_from_env() == (0 if _kernel().tiles() else 2)  # tiles: the hardware prefetcher alone
    monkeypatch.setenv("EYAS_HEAD_I8_TILES", "0")
    assert set_prefetch_from_env() == 2


def _fresh_choice(monkeypatch, tmp_path, seconds):
    """bf16_int8_pays with a fresh cache under tmp_path and the timing replaced by ``seconds`` (q8, int8)."""
    from eyas.models import int8_rows

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setattr(int8_rows, "time_head_kernels", lambda q8: seconds)
    int8_rows.bf16_int8_pays.cache_clear()
    try:
        return int8_rows.bf16_int8_pays()
    finally:
        int8_rows.bf16_int8_pays.cache_clear()


def test_bf16_heads_go_int8_only_where_it_pays_and_the_choice_is_cached(monkeypatch, tmp_path):
    from eyas import kernels

    q8 = kernels.gguf_bf16()
    if q8 is None or not q8.available():
        pytest.skip("needs the bf16 block kernel (AVX512-BF16)")
    assert _fresh_choice(monkeypatch, tmp_path / "a", (1.0, 0.4))  # 0.4 of the Q8_0 time: int8
    assert not _fresh_choice(monkeypatch, tmp_path / "b", (1.0, 0.8))  # 0.8: Q8_0 stays
    [cached] = list((tmp_path / "a" / "head_int8").glob("*.json"))
    assert cached.read_text().count('"int8": true') == 1
    # a second process reads the machine's choice without timing again
    assert _fresh_choice(monkeypatch, tmp_path / "a", (1.0, 2.0))


def test_int8_head_ready_by_dtype_and_mode(monkeypatch):
    from eyas.models import int8_rows

    monkeypatch.setattr(int8_rows, "bf16_int8_pays", lambda: False)
    monkeypatch.setenv("EYAS_HEAD_INT8", "auto")
    assert int8_rows.int8_head_ready(torch.float32) and not int8_rows.int8_head_ready(torch.bfloat16)
    monkeypatch.setattr(int8_rows, "bf16_int8_pays", lambda: True)
    assert int8_rows.int8_head_ready(torch.bfloat16) and not int8_rows.int8_head_ready(torch.float16)
    monkeypatch.setenv("EYAS_HEAD_INT8", "0")
    assert not int8_rows.int8_head_ready(torch.float32) and not int8_rows.int8_head_ready(torch.bfloat16)
    monkeypatch.setenv("EYAS_HEAD_INT8", "1")
    monkeypatch.setattr(int8_rows, "bf16_int8_pays", lambda: False)
    assert int8_rows.int8_head_ready(torch.bfloat16)


def test_the_timing_runs_both_kernels():
    from eyas import kernels

    q8 = kernels.gguf_bf16()
    if q8 is None or not q8.available():
        pytest.skip("needs the bf16 block kernel (AVX512-BF16)")
    from eyas.models.int8_rows import time_head_kernels

    q8_s, i8_s = time_head_kernels(q8, shapes=((64, 128), (32, 64)), rows=(1, 2), rounds=1, repeats=1)
    assert 0 < q8_s < 1 and 0 < i8_s < 1
