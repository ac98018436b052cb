"""Committing an accepted tree path leaves the cache as if the path had been decoded plainly.

After a tree forward at slots P .. P + N and ``commit(cache, P, path)``, the first
P + A slots must equal (fp32, tight) the cache built by decoding the same tokens
one at a time, and the one built by a single chain prefill; the next forward
must then give the same logits.
"""

from __future__ import annotations

import pytest
import torch

from eyas.kv.static import KVCache
from eyas.models.hf import HFTarget

# fp32: tree and plain forwards differ only in matmul shapes, so cached keys/values
# agree to float rounding (measured max |diff| ~1e-6 at |k| ~ 1-10)
KV_ATOL = 1e-5
LOGITS_ATOL = 1e-4

PREFIX = 10
# 0 -> {1, 2}, 2 -> 3, 3 -> {4, 6}, 1 -> 5
PARENTS = [-1, 0, 0, 2, 3, 1, 3]
# accepted paths (node indices from the root); [0, 2, 3, 4] moves slots 2, 3, 4 to 1, 2, 3:
# every target slot but the first is also a source slot (overlap)
PATHS = [[0], [0, 1], [0, 1, 5], [0, 2, 3, 4], [0, 2, 3, 6]]


def test_kv_commit_gathers_before_writing():
    """Slot contents move as documented, including overlapping and reordering moves."""
    cache = KVCache.empty(1, 1, 1, 8, 1, torch.float32)
    cache.k[..., 0] = torch.arange(8.0)
    cache.v[..., 0] = -torch.arange(8.0)
    cache.commit(2, torch.tensor([0, 2, 3, 4]))  # overlapping: 4->5 after 3->4 read
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 1, 2, 4, 5, 6, 6, 7]
    assert cache.v[0, 0, 0, :, 0].tolist() == [-0, -1, -2, -4, -5, -6, -6, -7]
    cache.commit(1, torch.tensor([1, 0]))  # swap: both slots are source and target
    assert cache.k[0, 0, 0, :4, 0].tolist() == [0, 2, 1, 4]


def _tree_then_commit(target, tiny, prefix, node_tokens, path):
    cache = target.new_cache(1, 32)
    target.forward(prefix, torch.arange(PREFIX)[None], cache, 0)
    toks, pos, mask = tiny.tree_inputs(PARENTS, node_tokens, PREFIX)
    target.forward(toks, pos, cache, PREFIX, mask=mask)
    target.commit(cache, PREFIX, torch.tensor(path))
    return cache


def _decoded(target, seq: torch.Tensor, chunks: list[int]):
    """Cache after feeding ``seq`` [1, L] in the given chunk sizes (plain causal forwards)."""
    cache = target.new_cache(1, 32)
    lo = 0
    for size in chunks:
        target.forward(seq[:, lo : lo + size], torch.arange(lo, lo + size)[None], cache, lo)
        lo += size
    return cache


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_native_commit_equals_plain_decoding(tiny, kind, path):
    native = tiny.native(kind)
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    cache = _tree_then_commit(native, tiny, prefix, node_tokens, path)
    seq = torch.cat([prefix, node_tokens[path][None]], dim=1)
    n = PREFIX + len(path)
    one_by_one = _decoded(native, seq, [PREFIX] + [1] * len(path))
    chain = _decoded(native, seq, [n])
    for ref in (one_by_one, chain):
        torch.testing.assert_close(cache.k[:, :, :, :n], ref.k[:, :, :, :n], atol=KV_ATOL, rtol=0)
        torch.testing.assert_close(cache.v[:, :, :, :n], ref.v[:, :, :, :n], atol=KV_ATOL, rtol=0)
    # the next step sees the committed prefix exactly as the plain cache
    nxt, pos = tiny.tokens(1, seed=3), torch.tensor([[n]])
    got = native.forward(nxt, pos, cache, n).logits
    torch.testing.assert_close(got, native.forward(nxt, pos, one_by_one, n).logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_hf_commit_equals_plain_decoding(tiny, path):
    hf, native = tiny.pair("qwen2")
    target = HFTarget(hf)
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    cache = _tree_then_commit(target, tiny, prefix, node_tokens, path)
    seq = torch.cat([prefix, node_tokens[path][None]], dim=1)
    n = PREFIX + len(path)
    for ref in (_decoded(target, seq, [PREFIX] + [1] * len(path)), _decoded(target, seq, [n])):
        assert torch.equal(cache.tokens[:, :n], ref.tokens[:, :n])
        assert torch.equal(cache.positions[:, :n], ref.positions[:, :n])
        assert torch.equal(cache.visibility(n), ref.visibility(n))
    nxt, pos = tiny.tokens(1, seed=3), torch.tensor([[n]])
    got = target.forward(nxt, pos, cache, n).logits
    want = native.forward(nxt, pos, _decoded(native, seq, [n]), n).logits
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
