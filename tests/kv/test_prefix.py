"""Prefix caching (eyas.kv.prefix): a prompt that starts with a stored one prefills only the rest, and nothing
it produces changes: the cache bits, the first token, the speculative and plain outputs (bf16 exact mode).
"""

from __future__ import annotations

import pytest
import torch

from eyas.decode import PREFILL_QUANTUM, DecodeConfig, SpecDecoder, next_span
from eyas.kv.prefix import PrefixCacheConfig, PrefixEntry, PrefixStore, common_prefix
from tests.conftest import BF16_CHUNKING
from tests.test_lossless import make_drafter, prompt_ids


def _entry(tokens: list[int], dtype=torch.bfloat16, taps=(2,), hidden=True, slot_bytes: int = 0) -> PrefixEntry:
    n = len(tokens)
    kv = torch.zeros(1, 1, 1, n, max(slot_bytes // 2, 1), dtype=dtype)
    return PrefixEntry(
        torch.tensor(tokens), kv, kv.clone(), torch.zeros(n, 4) if hidden else None,
        {t: torch.zeros(n, 4) for t in taps} if hidden else {},
    )


def test_a_records_size_is_known_before_copying():
    from eyas.kv.prefix import PromptRecord
    from eyas.kv.static import KVCache

    cache = KVCache.empty(2, 1, 3, 64, 4, torch.bfloat16)
    rec = PromptRecord()
    rec.add(torch.zeros(10, 6), {1: torch.zeros(10, 6)})
    prompt = torch.arange(10)
    assert rec.nbytes(10, cache) == rec.entry(prompt, cache).nbytes
    store = PrefixStore(PrefixCacheConfig(max_bytes=rec.nbytes(10, cache) - 1))
    store.keep(prompt, cache, rec)  # one byte too large: not stored
    assert len(store) == 0
    store.cfg.max_bytes += 1
    store.keep(prompt, cache, rec)
    assert len(store) == 1


def test_common_prefix():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix(a, torch.tensor([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, torch.tensor([1, 2, 9, 4])) == 2
    assert common_prefix(a, torch.tensor([7])) == 0
    assert common_prefix(a, torch.tensor([], dtype=torch.long)) == 0


def test_lookup_cuts_the_hit_to_the_quantum_and_leaves_the_last_token():
    store = PrefixStore()
    store.insert(_entry(list(range(40))))
    assert store.lookup(torch.arange(37), torch.bfloat16, (2,)).length == 32  # 37 shared, cut to 32
    assert store.lookup(torch.arange(40), torch.bfloat16, (2,)).length == 32  # the last token is prefilled: 39 -> 32
    assert store.lookup(torch.arange(41), torch.bfloat16, (2,)).length == 40
    assert store.lookup(torch.arange(7), torch.bfloat16, (2,)) is None  # under one quantum
    assert store.lookup(torch.tensor([5, *range(1, 40)]), torch.bfloat16, (2,)) is None  # differs at the start
    assert (store.queried_tokens, store.hit_tokens) == (37 + 40 + 41 + 7 + 40, 32 + 32 + 40)


def test_lookup_needs_the_dtype_and_the_drafters_features():
    store = PrefixStore()
    store.insert(_entry(list(range(40)), taps=(2,)))
    p = torch.arange(41)
    assert store.lookup(p, torch.float32, (2,)) is None  # other cache dtype: other bits
    assert store.lookup(p, torch.bfloat16, (2, 5)) is None  # the drafter reads a tap the entry lacks
    assert store.lookup(p, torch.bfloat16, None).length == 40  # a plain decoder reads no features
    store.clear()
    store.insert(_entry(list(range(40)), hidden=False))  # stored by a plain decoder
    assert store.lookup(p, torch.bfloat16, ()) is None and store.lookup(p, torch.bfloat16, None).length == 40


def test_the_store_keeps_its_own_copy_of_the_keys_and_values():
    """PromptRecord.entry hands the store views of the cache; the cache is reused by the next sequence."""
    store, entry = PrefixStore(), _entry(list(range(16)), slot_bytes=8)
    store.insert(entry)
    entry.k.fill_(1.0)  # the caller's cache is overwritten
    hit = store.lookup(torch.arange(17), torch.bfloat16, (2,))
    assert hit.length == 16 and hit.entry.k is not entry.k and not hit.entry.k.any()


def test_insert_replaces_the_prompts_it_extends_and_evicts_the_oldest():
    store = PrefixStore(PrefixCacheConfig(max_bytes=10_000))
    store.insert(_entry(list(range(20))))
    store.insert(_entry(list(range(30))))  # extends the first: replaces it
    store.insert(_entry(list(range(25))))  # held by the second already: not stored again
    assert len(store) == 1 and store.lookup(torch.arange(31), torch.bfloat16, (2,)).length == 24
    store.insert(_entry(list(range(20)), hidden=False))  # held, by an entry with richer features
    assert len(store) == 1
    store.insert(_entry(list(range(100, 140))))
    store.insert(_entry(list(range(200, 240))))
    one = store._entries[next(iter(store._entries))].nbytes
    big = PrefixStore(PrefixCacheConfig(max_bytes=2 * one + 1))
    for start in (0, 100, 200):
        big.insert(_entry(list(range(start, start + 30))))
    assert len(big) == 2 and big.lookup(torch.arange(31), torch.bfloat16, (2,)) is None  # the oldest went
    big.insert(_entry(list(range(1000)), slot_bytes=64))  # larger than the whole store: not kept
    assert len(big) == 2


# ---- in the decoder: bf16 exact mode, tiny native targets ------------------------------------------------
def _bf16(tiny, kind):
    return tiny.native(kind, seed=0, max_position_embeddings=2048).to(torch.bfloat16)


def _prefill(target, prompt, store=None, drafter=None, chunk=128):
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=4, exact=True), store)
    *_, seq = dec.prefill_steps(prompt, next_end=lambda s, t: next_span(s, t, chunk))
    t = prompt.shape[0]
    return dec, (seq.cache.k[:, :, :, :t].clone(), seq.cache.v[:, :, :, :t].clone(), seq.history[-1].item())


@BF16_CHUNKING
@pytest.mark.parametrize("kind", ("llama", "qwen3"))
def test_a_hit_fills_the_cache_bits_of_a_full_prefill(tiny, kind):
    target = _bf16(tiny, kind)
    first = prompt_ids(37, seed=1)
    second = torch.cat([first[:35], prompt_ids(300, seed=2)])  # shares 35 tokens: 32 reused
    store = PrefixStore()
    _prefill(target, first, store)
    dec, got = _prefill(target, second, store, chunk=16)
    _, ref = _prefill(target, second)
    assert dec.cached_prompt_tokens == 32
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] == ref[2]
    dec, again = _prefill(target, second, store)  # the whole second prompt is stored now: all but its tail
    assert dec.cached_prompt_tokens == (second.shape[0] - 1) // PREFILL_QUANTUM * PREFILL_QUANTUM
    assert torch.equal(again[0], ref[0]) and again[2] == ref[2]


def _turns(n: int = 3) -> list[torch.Tensor]:
    """A chat's prompts: each turn's prompt is the previous one, an answer and a new message."""
    turns, p = [], prompt_ids(20, seed=3)
    for i in range(n):
        turns.append(p)
        p = torch.cat([p, prompt_ids(11 + i, seed=10 + i), prompt_ids(9, seed=20 + i)])
    return turns


@pytest.mark.parametrize("kind", ("llama", "qwen3"))
@pytest.mark.parametrize("drafter_name", ("eagle3|dynamic:4,4,12", "hybrid|dynamic:4,4,12", "ngram_b3"))
def test_greedy_output_with_the_prefix_cache_equals_plain(tiny, kind, drafter_name):
    """Every turn of a chat, speculative with reuse, equals plain decoding without it; later turns reuse."""
    target = _bf16(tiny, kind)
    drafter = make_drafter(drafter_name, target, kind, tiny)
    store = PrefixStore()
    for i, p in enumerate(_turns()):
        ref = [t for ev in SpecDecoder(target, None, DecodeConfig(max_new_tokens=12, exact=True)).generate(p)
               for t in ev.tokens.tolist()]
        dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=12, exact=True), store)
        out = [t for ev in dec.generate(p) for t in ev.tokens.tolist()]
        assert out == ref, i
        assert (dec.cached_prompt_tokens > 0) == (i > 0)


def test_a_hit_from_a_plain_request_does_not_serve_a_drafter(tiny):
    target = _bf16(tiny, "llama")
    drafter = make_drafter("eagle3|dynamic:4,4,12", target, "llama", tiny)
    store = PrefixStore()
    p = prompt_ids(40, seed=4)
    list(SpecDecoder(target, None, DecodeConfig(max_new_tokens=2, exact=True), store).generate(p))
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=2, exact=True), store)
    list(dec.generate(torch.cat([p, p])))
    assert dec.cached_prompt_tokens == 0
    plain = SpecDecoder(target, None, DecodeConfig(max_new_tokens=2, exact=True), store)
    list(plain.generate(torch.cat([p, p, p])))
    assert plain.cached_prompt_tokens == 80  # the drafter's entry (features and all) serves a plain decoder


def test_outside_exact_mode_nothing_is_reused(tiny):
    target = tiny.native("llama", seed=0)
    store = PrefixStore()
    p = prompt_ids(40, seed=4)
    for _ in range(2):
        dec = SpecDecoder(target, None, DecodeConfig(max_new_tokens=2), store)
        list(dec.generate(p))
        assert dec.cached_prompt_tokens == 0
    assert len(store) == 0
