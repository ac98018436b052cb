"""The compiled exact-mode tree attention (eyas/kernels/path_attn.cpp) on its own.

Row r attends slots 0 .. start - 1, then its path's slots, in that order. Checked: the result is attention's
(within fp32 rounding), and a row's bits do not depend on where its path's entries sit in the cache, on how
many rows share the call, nor on the thread count: what makes a tree node's output equal the plain step's.
"""

from __future__ import annotations

import pytest
import torch

from eyas import kernels


@pytest.fixture(scope="module")
def kernel():
    mod = kernels.path_attention()
    if mod is None:
        pytest.skip("the compiled tree attention is unavailable here (no C++ toolchain)")
    return mod


def _reference(q, k, v, slots, scale):
    """q [H, Dh], k/v [Hk, S, Dh], slots [L] -> [H, Dh] in float64."""
    h, hk = q.shape[0], k.shape[0]
    out = []
    for head in range(h):
        kv = head // (h // hk)
        w = ((k[kv, slots].double() @ q[head].double()) * scale).softmax(-1)
        out.append(w @ v[kv, slots].double())
    return torch.stack(out)


# (query heads, KV heads, head_dim): SmolLM2's 9/3/64, a tiny test model's 4/2/16, Qwen3-like 16/8/128
@pytest.mark.parametrize("h,hk,dh", [(9, 3, 64), (4, 2, 16), (16, 8, 128), (8, 8, 32)])
@pytest.mark.parametrize("start", [0, 1, 37, 300])
def test_matches_attention(kernel, h, hk, dh, start):
    g = torch.Generator().manual_seed(start + dh)
    k, v = torch.randn(hk, 400, dh, generator=g), torch.randn(hk, 400, dh, generator=g)
    paths = torch.tensor([[start, 0, 0], [start, start + 1, 0], [start, start + 2, 0], [start, start + 1, start + 3]])
    lengths = torch.tensor([1, 2, 2, 3])
    q = torch.randn(4, h, dh, generator=g)
    out = kernel.path_attention(q, k, v, start, paths, lengths, dh**-0.5)
    for r in range(4):
        slots = torch.cat([torch.arange(start), paths[r, : lengths[r]]])
        torch.testing.assert_close(out[r].double(), _reference(q[r], k, v, slots, dh**-0.5), atol=2e-6, rtol=1e-5)


def test_a_nodes_bits_are_the_plain_steps_after_commit(kernel):
    """A node whose path entries sit at scattered tree slots gets the bits a one-row call computes once the
    path is committed to consecutive slots, whatever the other rows and the thread count."""
    g = torch.Generator().manual_seed(0)
    h, hk, dh, start = 9, 3, 64, 250
    k, v = torch.randn(hk, 320, dh, generator=g), torch.randn(hk, 320, dh, generator=g)
    paths = torch.tensor([[start + i for i in p] + [0] * (4 - len(p)) for p in ([0], [0, 2], [0, 3, 5], [0, 1, 4, 6])])
    lengths = torch.tensor([1, 2, 3, 4])
    q = torch.randn(4, h, dh, generator=g)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            results.append(kernel.path_attention(q, k, v, start, paths, lengths, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    for r in range(4):
        kc, vc = k.clone(), v.clone()
        n = int(lengths[r])
        kc[:, start : start + n] = k[:, paths[r, :n]]  # commit: the path moves to slots start ..
        vc[:, start : start + n] = v[:, paths[r, :n]]
        last = start + n - 1
        plain = kernel.path_attention(q[r : r + 1].contiguous(), kc, vc, last, torch.tensor([[last]]),
                                      torch.tensor([1]), 0.125)
        assert torch.equal(plain[0], results[0][r]), r


def test_unsupported_shapes_are_refused(kernel):
    assert kernel.supports(3, 64) and kernel.supports(2, 16)
    assert not kernel.supports(3, 80)
    with pytest.raises(RuntimeError, match="unsupported head_dim"):
        kernel.path_attention(torch.zeros(1, 3, 80), torch.zeros(1, 8, 80), torch.zeros(1, 8, 80), 0,
                              torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)


def test_off_switch(monkeypatch):
    monkeypatch.setenv("EYAS_PATH_KERNEL", "0")
    assert kernels.path_attention() is None


@pytest.mark.parametrize("h,hk,dh", [(9, 3, 64), (4, 2, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_reads_each_row_over_its_own_length(kernel, h, hk, dh, threads):
    """Batched one-token decode (eyas data): row b attends slots < lengths[b] of its own cache row, equal to
    attention under the prefix mask; the cache is a strided view (layer l, rows lo..hi of the full cache)."""
    g = torch.Generator().manual_seed(dh + threads)
    full_k, full_v = torch.randn(2, 7, hk, 200, dh, generator=g), torch.randn(2, 7, hk, 200, dh, generator=g)
    k, v = full_k[1, 2:7], full_v[1, 2:7]  # [5, Hk, 200, Dh], not contiguous
    lengths = torch.tensor([1, 200, 37, 64, 150])
    q = torch.randn(5, h, dh, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel.decode_attention(q, k, v, lengths, dh**-0.5)
    finally:
        torch.set_num_threads(old)
    for b in range(5):
        slots = torch.arange(int(lengths[b]))
        torch.testing.assert_close(out[b].double(), _reference(q[b], k[b], v[b], slots, dh**-0.5), atol=2e-6,
                                   rtol=1e-5)
    with pytest.raises(RuntimeError, match="length out of range"):
        kernel.decode_attention(q, k, v, torch.tensor([1, 2, 3, 4, 201]), dh**-0.5)


def test_decode_attention_reads_a_bf16_cache_as_its_fp32_values(kernel):
    """A bf16 model's keys/values are bf16 before they are cached: a bf16 cache gives the fp32 cache's bits."""
    if not kernel.decode_bf16():
        with pytest.raises(RuntimeError, match="bf16"):
            kernel.decode_attention(torch.randn(2, 9, 64), *(torch.randn(2, 3, 8, 64).bfloat16(),) * 2,
                                    torch.tensor([3, 8]), 0.125)
        return
    g = torch.Generator().manual_seed(5)
    k = torch.randn(4, 3, 300, 64, generator=g).bfloat16()
    v = torch.randn(4, 3, 300, 64, generator=g).bfloat16()
    q = torch.randn(4, 9, 64, generator=g)
    lengths = torch.tensor([1, 17, 300, 128])
    out = kernel.decode_attention(q, k, v, lengths, 0.125)
    assert torch.equal(out, kernel.decode_attention(q, k.float(), v.float(), lengths, 0.125))
