"""The compiled decode-layer step (eyas/kernels/layer_ops.cpp): RoPE, cache write and q's conversion in one call.

It replaces torch ops in exact mode's decode and verify forwards, so it must give their bits exactly: the
rotated q, and the k and v it writes into the float32 cache, equal ``Rope.apply`` + ``KVCache.update``'s; a
whole exact-mode verify forward (bf16 or float32) gives the same logits and cache with it and without it.
"""

from __future__ import annotations

import pytest
import torch

from eyas import kernels
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.models import attention
from eyas.models.native import Rope, rope_table
from eyas.tree import make_tree

OPS = kernels.layer_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ toolchain for eyas/kernels/layer_ops.cpp")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,hk,dh,n", [(9, 3, 64, 1), (9, 3, 64, 5), (4, 2, 16, 3), (16, 8, 128, 2)])
def test_rope_cache_gives_torchs_bits(h, hk, dh, n, dtype):
    g = torch.Generator().manual_seed(dh + n)
    qkv = (torch.randn(1, n, h + 2 * hk, dh, generator=g) * 3).to(dtype)
    start = 37
    positions = torch.arange(start, start + n)[None]
    rope = Rope(rope_table(1.0 / 10000 ** (torch.arange(0, dh, 2).float() / dh), 100), positions, dtype)
    ref = rope.apply(qkv[:, :, : h + hk])  # [1, N, H + Hk, Dh]
    kc, vc = torch.full((hk, 64, dh), 7.0), torch.full((hk, 64, dh), 7.0)
    cos, sin = rope.rows
    q = OPS.rope_cache(qkv[0], cos, sin, kc, vc, start, h)
    assert q.dtype == torch.float32 and q.shape == (n, h, dh)
    assert torch.equal(q, ref[0, :, :h].float())
    assert torch.equal(kc[:, start : start + n], ref[0, :, h:].float().transpose(0, 1))
    assert torch.equal(vc[:, start : start + n], qkv[0, :, h + hk :].float().transpose(0, 1))
    assert bool((kc[:, :start] == 7).all() and (kc[:, start + n :] == 7).all())  # nothing else written
    with pytest.raises(RuntimeError, match="past the cache"):
        OPS.rope_cache(qkv[0], cos, sin, kc, vc, 64 - n + 1, h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_exact_verify_forward_is_the_same_with_and_without_it(tiny, monkeypatch, dtype):
    target = tiny.native("llama", seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64).to(dtype)
    if target.path_kernel() is None:
        pytest.skip("the compiled tree attention is unavailable here")
    prompt = tiny.tokens(70, seed=2)[0]
    parents = torch.tensor([-1, 0, 0, 1, 3])
    calls = []

    class Spy:  # the kernel, counting its calls
        def rope_cache(self, *a):
            calls.append(a[0].shape)
            return OPS.rope_cache(*a)

    runs = []
    for fused in (True, False):
        monkeypatch.setattr(attention, "_layer_ops", (lambda: Spy()) if fused else (lambda: None))
        dec = SpecDecoder(target, None, DecodeConfig(max_new_tokens=8, exact=True))
        seq = dec.prefill(prompt)  # exact prefill attends through the kernel too (causal paths)
        tree = make_tree(torch.cat([seq.history[-1:], tiny.tokens(4, seed=5)[0]]), parents)
        out = dec.verify_forward(seq, tree)
        runs.append((out.logits, seq.cache.k.clone(), seq.cache.v.clone()))
    # the fused run took it in every layer, for the prompt and for the tree
    assert [c[0] for c in calls] == [70] * target.config.num_layers + [5] * target.config.num_layers
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)


def test_rope_cache_refuses_mixed_dtypes():
    h, hk, dh, n = 4, 2, 16, 2
    qkv = torch.randn(n, h + 2 * hk, dh)
    cos = sin = torch.randn(n, dh)
    with pytest.raises(RuntimeError, match="in qkv's dtype"):
        OPS.rope_cache(qkv, cos.bfloat16(), sin.bfloat16(), torch.zeros(hk, 8, dh), torch.zeros(hk, 8, dh), 0, h)
    with pytest.raises(RuntimeError, match="float32 qkv writes a float32 cache"):
        OPS.rope_cache(qkv, cos, sin, torch.zeros(hk, 8, dh).bfloat16(), torch.zeros(hk, 8, dh).bfloat16(), 0, h)


def test_rope_cache_writes_a_bf16_cache_with_the_same_values():
    g = torch.Generator().manual_seed(0)
    h, hk, dh, n, start = 9, 3, 64, 3, 10
    qkv = torch.randn(n, h + 2 * hk, dh, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(n, dh, generator=g).to(torch.bfloat16), torch.randn(n, dh, generator=g).to(torch.bfloat16)
    k32, v32 = torch.zeros(hk, 16, dh), torch.zeros(hk, 16, dh)
    k16, v16 = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
    q32 = OPS.rope_cache(qkv, cos, sin, k32, v32, start, h)
    assert torch.equal(q32, OPS.rope_cache(qkv, cos, sin, k16, v16, start, h))
    assert torch.equal(k16.float(), k32) and torch.equal(v16.float(), v32)


def test_exact_mode_on_a_bf16_cache_gives_the_float32_caches_bits(tiny, monkeypatch):
    target = tiny.native("llama", seed=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64).to(torch.bfloat16)
    kernel = target.path_kernel()
    if kernel is None or not kernel.decode_bf16():
        pytest.skip("no compiled attention reading a bf16 cache here (AVX-512)")
    prompt = tiny.tokens(90, seed=6)[0]
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(type(target), "decode_kv_dtype", lambda self, d=dtype: d)
        dec = SpecDecoder(target, None, DecodeConfig(max_new_tokens=8, exact=True))
        seq = dec.prefill(prompt)
        assert seq.cache.k.dtype == dtype
        tree = make_tree(torch.cat([seq.history[-1:], tiny.tokens(4, seed=7)[0]]), torch.tensor([-1, 0, 0, 1, 3]))
        runs.append(dec.verify_forward(seq, tree).logits)
        for _ in range(3):  # plain steps after a commit read what the tree wrote
            dec.step(seq)
        runs.append(seq.history.clone())
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[3])
