"""The draft head's layer on the compiled CPU kernels (eyas.drafters.head_kernels): the same layer as the torch
path up to rounding (bf16 or float32 heads), the attention pattern ``HeadPaths`` describes, and used where it
serves."""

from __future__ import annotations

import pytest
import torch

from eyas import kernels
from eyas.drafters.eagle import EagleDrafter, random_head
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.drafters.head_kernels import HeadPaths
from eyas.models.base import causal_mask

GGUF = kernels.gguf_bf16()
GGUF_F32 = kernels.gguf_f32()
_OTHERS = kernels.layer_ops() is not None and kernels.path_attention() is not None
needs_kernels = pytest.mark.skipif(
    GGUF is None or not GGUF.available() or not _OTHERS, reason="needs the compiled kernels on a CPU with AVX512-BF16"
)
needs_f32_kernels = pytest.mark.skipif(
    GGUF_F32 is None or not GGUF_F32.available() or not _OTHERS, reason="needs the compiled float32 kernels (AVX2)"
)
DTYPES = (pytest.param(torch.bfloat16, marks=needs_kernels, id="bf16"),
          pytest.param(torch.float32, marks=needs_f32_kernels, id="f32"))


def test_head_paths_causal() -> None:
    p = HeadPaths.causal(5, 3)
    assert p.prefix == 5 and p.lengths.tolist() == [1, 2, 3]
    assert [row[:n] for row, n in zip(p.slots.tolist(), p.lengths.tolist(), strict=True)] == [[5], [5, 6], [5, 6, 7]]


def test_head_paths_from_seen() -> None:
    # feed of depth 2 after two depth-1 nodes (fed slots 0, 1): rows see their parent and themselves
    p = HeadPaths.from_seen(10, [[0, 2], [1, 3]])
    assert p.prefix == 10 and p.lengths.tolist() == [2, 2]
    assert p.slots.tolist() == [[10, 12], [11, 13]]
    ragged = HeadPaths.from_seen(4, [[0], [0, 1]])
    assert ragged.slots.tolist() == [[4, 4], [4, 5]] and ragged.lengths.tolist() == [1, 2]


def test_frontier_and_feed_hand_the_same_attended_entries_as_their_masks() -> None:
    from eyas.drafters.expansion import make_expansion

    logp = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), -1)
    for exp in (make_expansion("dynamic:3,4,8"),
                make_expansion("static:[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")):
        feed, levels = exp.start(torch.tensor(7), logp), 0
        while feed is not None:
            seen = [[j for j, v in enumerate(row) if v] for row in feed.mask.tolist()]
            assert feed.seen == seen and all(row[-1] == feed.mask.shape[1] - feed.tokens.shape[0] + r
                                             for r, row in enumerate(seen))  # each node attends itself, last
            levels += 1
            feed = exp.grow(logp.expand(feed.tokens.shape[0], -1))
        assert levels >= 2


def _drafter(tiny, kind: str = "eagle3", dtype: torch.dtype = torch.bfloat16):
    target = tiny.native("llama", seed=0).to(dtype)
    if kind == "eagle":
        return EagleDrafter(target_model=target, head=random_head(target.config, seed=3), tree="dynamic:2,3,4")
    head = random_eagle3_head(target.config, draft_vocab_size=128, seed=3)
    return Eagle3Drafter(target_model=target, head=head, tree="dynamic:2,3,4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_drafters_take_the_fast_layer(tiny, dtype, monkeypatch) -> None:
    assert _drafter(tiny, dtype=dtype).fast
    assert _drafter(tiny, "eagle", dtype).fast
    monkeypatch.setenv("EYAS_HEAD_FAST", "0")
    assert not _drafter(tiny, dtype=dtype).fast and not _drafter(tiny, "eagle", dtype).fast


@needs_f32_kernels
def test_an_unquantised_head_keeps_the_torch_layer(tiny, monkeypatch) -> None:
    monkeypatch.setenv("EYAS_HEAD_Q8", "0")  # no blocks, nothing to fuse
    assert not _drafter(tiny, dtype=torch.float32).fast


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ("eagle3", "eagle"))
@pytest.mark.parametrize("case", ("extend", "tree"))
def test_fast_forward_equals_the_torch_layer(tiny, case, kind, dtype) -> None:
    """Same weights (the fused Q8_0 blocks are the per-projection blocks), same attention pattern: outputs and
    the cached keys/values agree to rounding (in bf16 RoPE rounds once instead of three times, and the kernels sum
    in another order; in float32 to float32 rounding: the kernels sum in another order)."""
    d = _drafter(tiny, kind, dtype)
    assert d.fast
    h, cfg = d.head, d.head.config
    g = torch.Generator().manual_seed(0)
    n, t = 9, 3  # committed slots, new rows
    emb = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
    hid = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
    prefix_k = torch.randn(cfg.num_kv_heads, n + 3, cfg.head_dim, generator=g)
    if case == "extend":  # rows at positions n .. n + 2, causal
        pos, paths = torch.arange(n, n + t), HeadPaths.causal(n, t)
        write, mask = n, causal_mask(t, n, device="cpu")[None]
    else:  # three depth-2 nodes after three fed depth-1 nodes (slots n .. n + 2): parents 0, 0, 2
        vis = [[True, False, False, True, False, False], [True, False, False, False, True, False],
               [False, False, True, False, False, True]]
        pos, paths = torch.full((t,), n + 1), HeadPaths.from_seen(n, [[j for j, v in enumerate(r) if v] for r in vis])
        write = n + 3
        mask = torch.cat([torch.ones(t, n, dtype=torch.bool), torch.tensor(vis)], dim=1)[None]
    outs, caches = [], []
    for fast in (False, True):
        d.start(64)
        cache = d.state.cache
        cache.k[0, 0, :, : n + 3] = prefix_k  # committed (and, for the tree, fed) entries both paths read
        cache.v[0, 0, :, : n + 3] = prefix_k.flip(-1)
        with torch.inference_mode():
            if fast:
                outs.append(h.fast_forward(emb, hid, pos, cache, write, paths))
            else:
                outs.append(h(emb[None], hid[None], pos[None], cache, write, mask)[0])
        caches.append((cache.k[0, 0, :, write : write + t].clone(), cache.v[0, 0, :, write : write + t].clone()))
    ref, got = outs[0].float(), outs[1].float()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype == torch.float32:
        for x, y in ((got, ref), *zip(caches[1], caches[0], strict=True)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
        return
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    torch.testing.assert_close(caches[1][1], caches[0][1])  # v: the projection's values, no RoPE
    assert (caches[1][0] - caches[0][0]).abs().max() <= 0.02 * caches[0][0].abs().max()
