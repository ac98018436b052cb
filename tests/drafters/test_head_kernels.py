"""The draft head's layer on the compiled CPU kernels (eyas.drafters.head_kernels): the same layer as the torch
path up to bf16 rounding, the attention pattern ``HeadPaths`` describes, and used where it serves."""

from __future__ import annotations

import pytest
import torch

from eyas import kernels
from eyas.drafters.eagle import EagleDrafter, random_head
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.drafters.head_kernels import HeadPaths
from eyas.models.base import causal_mask

GGUF = kernels.gguf_bf16()
needs_kernels = pytest.mark.skipif(
    GGUF is None or not GGUF.available() or kernels.layer_ops() is None or kernels.path_attention() is None,
    reason="needs the compiled kernels on a CPU with AVX512-BF16",
)


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


def _drafter(tiny, kind: str = "eagle3"):
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    if kind == "eagle":
        return EagleDrafter(target_model=target, head=random_head(target.config, seed=3), tree="dynamic:2,3,4")
    head = random_eagle3_head(target.config, draft_vocab_size=128, seed=3)
    return Eagle3Drafter(target_model=target, head=head, tree="dynamic:2,3,4")


@needs_kernels
def test_drafters_take_the_fast_layer_for_a_bf16_head(tiny) -> None:
    assert _drafter(tiny).fast
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    assert EagleDrafter(target_model=target, head=random_head(target.config, seed=3), tree="dynamic:2,3,4").fast
    assert not EagleDrafter(target_model=tiny.native("llama", seed=0), head=random_head(target.config)).fast  # fp32


@needs_kernels
@pytest.mark.parametrize("kind", ("eagle3", "eagle"))
@pytest.mark.parametrize("case", ("extend", "tree"))
def test_fast_forward_equals_the_torch_layer(tiny, case, kind) -> None:
    """Same weights (the fused Q8_0 blocks are the per-projection blocks), same attention pattern: outputs and
    the cached keys/values agree to bf16 rounding (RoPE rounds once instead of three times, and the kernel sums
    in another order)."""
    d = _drafter(tiny, kind)
    assert d.fast
    h, cfg = d.head, d.head.config
    g = torch.Generator().manual_seed(0)
    n, t = 9, 3  # committed slots, new rows
    emb = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
    hid = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
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
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    torch.testing.assert_close(caches[1][1], caches[0][1])  # v: the projection's values, no RoPE
    assert (caches[1][0] - caches[0][0]).abs().max() <= 0.02 * caches[0][0].abs().max()
