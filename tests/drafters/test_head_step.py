"""The EAGLE-3 head's call as one native call (eyas.drafters.head_step): the torch fast path's outputs, cache entries
and draft log-probs, used where it serves, lossless in decoding, and bad input refused with the reason."""

from __future__ import annotations

import pytest
import torch

from eyas import kernels
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head

STEP = kernels.head_step()
needs_step = pytest.mark.skipif(STEP is None or not STEP.available(), reason="needs the compiled head step (AVX2)")
DTYPES = (pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16"))
LAYERS = (pytest.param(1, id="1-layer"), pytest.param(2, id="2-layer"))  # EAGLE-3's layer, then a plain one


def _drafter(tiny, dtype: torch.dtype, monkeypatch, layers: int = 1) -> Eagle3Drafter:
    monkeypatch.setenv("EYAS_HEAD_INT8", "1")  # int8 rows for a bf16 head too, whatever this CPU's timing says
    target = tiny.native("llama", seed=0).to(dtype)
    head = random_eagle3_head(target.config, draft_vocab_size=128, seed=3, num_layers=layers)
    g = torch.Generator().manual_seed(11)
    for name, w in head.named_parameters():  # norms apart from their ones, so that a norm taken for another differs
        if name.endswith("norm.weight"):
            w.data = (1 + 0.3 * torch.randn(w.shape, generator=g)).to(w.dtype)
    drafter = Eagle3Drafter(target_model=target, head=head, tree="dynamic:2,3,4")
    if drafter.step is None:
        pytest.skip("no int8 head here (the bf16 block kernel or the int8 kernel is missing)")
    return drafter


def _calls(d: Eagle3Drafter, step):
    """An extension of 5 rows after 7 committed slots, then a tree level of 3 nodes (parents 4, 4, 2 of it), through
    ``step`` (None: the torch fast path); returns every output, the log-probs and the cache entries written, and the
    calls' top-k (None on the torch path).
    """
    d.step = step
    d.start(64)
    cfg, g = d.head.config, torch.Generator().manual_seed(0)
    cache = d.state.cache
    cache.k[:, 0, :, :7] = torch.randn(cache.k.shape[0], cfg.num_kv_heads, 7, cfg.head_dim, generator=g)
    cache.v[:, 0, :, :7] = torch.randn(cache.v.shape[0], cfg.num_kv_heads, 7, cfg.head_dim, generator=g)
    dtype = d.head_dtype
    tokens = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
    feats = torch.randn(5, cfg.hidden_size, generator=g).to(dtype)
    with torch.inference_mode():
        a = d._fast_call(tokens, feats, None, 7, 1, 7, 7, [list(range(i + 1)) for i in range(5)], 4)
        b = d._fast_call([3, 9, 40], a.hidden, [4, 4, 2], 12, 0, 12, 12, [[0], [1], [2]], 0)
    outs = [a.hidden, a.logp, b.hidden, b.logp, cache.k[:, 0, :, 7:15].clone(), cache.v[:, 0, :, 7:15].clone()]
    return outs, (a.top, b.top)


@needs_step
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_call_is_the_torch_fast_path(tiny, dtype, layers, monkeypatch) -> None:
    """Same kernels, same roundings: outputs and cache entries to the bit but for silu's exp (at most one ulp of the
    head's dtype, rarely); log-probs to float32 rounding (vexp.h's exp against torch's); the same top draft tokens, and
    each row's top-k (the tree's 2) is its log-probs' as target ids. A two-layer head: its second layer's k and v in
    cache layer 1."""
    d = _drafter(tiny, dtype, monkeypatch, layers)
    step = d.step
    (ref, ref_top), (got, got_top) = _calls(d, None), _calls(d, step)
    for r, x in zip(ref, got, strict=True):
        assert x.shape == r.shape and x.dtype == r.dtype
    assert got[4].shape[0] == layers and bool(got[4][-1].abs().sum() > 0)  # every layer wrote its cache layer
    torch.testing.assert_close(got[4][0], ref[4][0], rtol=0, atol=0)  # layer 0's k: written before any MLP, to the bit
    torch.testing.assert_close(got[5][0], ref[5][0], rtol=0, atol=0)
    for i in (4, 5):  # a later layer's k and v come after an MLP's silu: within its output's ulp
        diff = (got[i][1:] - ref[i][1:]).abs()
        assert (diff <= 2 ** -6 * ref[i][1:].abs().clamp(min=1e-2)).all()
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    for i in (0, 2):
        diff = (got[i].float() - ref[i].float()).abs()
        assert (diff <= ulp * ref[i].float().abs().clamp(min=1e-3) * 2).all()
        assert (diff > 0).float().mean() < 0.05
    for i in (1, 3):
        torch.testing.assert_close(got[i], ref[i], rtol=0, atol=1e-4)
        assert torch.equal(got[i].argmax(-1), ref[i].argmax(-1))
    assert got[1].shape[0] == 1 and got[3].shape[0] == 3  # logits_from: the extension's last row only
    assert ref_top == (None, None)
    ids = d.head.draft_ids()
    for logp, (values, top_ids) in zip((got[1], got[3]), got_top, strict=True):
        want = logp.topk(2, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(top_ids, ids[want.indices])


@needs_step
def test_the_native_call_fuses_the_taps_as_the_head_does(tiny, monkeypatch) -> None:
    """A bf16 head's fc (Q8_0 blocks) inside the call: the same bits as Eagle3Head.fuse before it, from strided taps."""
    from eyas.drafters.base import TargetFeatures

    d = _drafter(tiny, torch.bfloat16, monkeypatch)
    if not d.step.fuses:
        pytest.skip("no bf16 block kernel here: the fused taps stay in Python")
    cfg, g = d.head.config, torch.Generator().manual_seed(4)
    big = torch.randn(len(d.taps), 9, cfg.hidden_size, generator=g).bfloat16()
    feats = TargetFeatures(hidden=big[0, :3], taps={layer: big[j, 2:5] for j, layer in enumerate(d.taps)})
    outs = []
    with torch.inference_mode():
        for native in (False, True):
            d.start(32)
            taps = d._native_taps(feats) if native else None
            hid = None if native else d._feature_in(feats)
            outs.append(d._fast_call([3, 7, 11], hid, None, 4, 1, 4, 4, [[0], [0, 1], [0, 1, 2]], 2, taps))
    a, b = outs
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logp, b.logp)
    assert all(torch.equal(x, y) for x, y in zip(a.top, b.top, strict=True))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="no rows"):
        d.step([3, 7, 11], None, [0, 1, 2], 4, 1, d.state.cache, 4, 4, [[0], [0, 1], [0, 1, 2]], 2,
               taps=d._native_taps(feats))


@needs_step
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_decoding_with_the_native_call_is_plain_greedy(tiny, dtype, layers, monkeypatch) -> None:
    d = _drafter(tiny, dtype, monkeypatch, layers)
    target = d.target
    prompt = torch.randint(0, target.config.vocab_size, (11,), generator=torch.Generator().manual_seed(5))

    def tokens(drafter) -> list[int]:
        dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=40, exact=dtype == torch.bfloat16))
        return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()]

    calls = []
    real = d.step.native

    class Spy:  # the native call, counted
        fuses = real.fuses

        def run(self, *args):
            calls.append(1)
            return real.run(*args)

    d.step.native = Spy()
    assert tokens(d) == tokens(None)
    assert len(calls) > 10  # the native call drafted: extensions and tree levels


def test_the_switch_keeps_the_torch_path(tiny, monkeypatch) -> None:
    monkeypatch.setenv("EYAS_HEAD_STEP", "0")
    target = tiny.native("llama", seed=0)
    d = Eagle3Drafter(target_model=target, head=random_eagle3_head(target.config, draft_vocab_size=128, seed=3))
    assert d.step is None


@needs_step
def test_bad_input_is_refused_with_the_reason(tiny, monkeypatch) -> None:
    d = _drafter(tiny, torch.float32, monkeypatch)
    d.start(32)
    cfg, cache = d.head.config, d.state.cache
    feats = torch.zeros(2, cfg.hidden_size)
    causal = [[0], [0, 1]]
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="outside the embedding"):
            d.step([1, cfg.vocab_size], feats, None, 0, 1, cache, 0, 0, causal, 1)
        with pytest.raises(RuntimeError, match="slots past the head's cache"):
            d.step([1, 2], feats, None, 0, 1, cache, 10_000, 0, causal, 1)
        with pytest.raises(RuntimeError, match="in the head's dtype"):
            d.step([1, 2], feats.bfloat16(), None, 0, 1, cache, 0, 0, causal, 1)
        with pytest.raises(RuntimeError, match="past the written slots"):
            d.step([1, 2], feats, None, 0, 1, cache, 0, 0, [[0], [0, 5]], 1)
        with pytest.raises(RuntimeError, match="outside hid"):
            d.step([1, 2], feats, [0, 2], 0, 1, cache, 0, 0, causal, 1)
