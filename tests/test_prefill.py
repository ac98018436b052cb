"""Chunked prefill (eyas.decode.prefill_spans): the schedule, and exact mode's chunking invariance.

Continuous batching prefills a joining prompt in small chunks between decode steps while eyas generate
uses large ones; in bf16 exact mode both must fill the same cache bits, or the served text would differ
from eyas generate's (issue 14).
"""

from __future__ import annotations

import pytest
import torch

from eyas.batch import PrefillBudget
from eyas.decode import (
    EXACT_PREFILL_ROWS,
    PREFILL_QUANTUM,
    PREFILL_TOKEN_KEYS,
    DecodeConfig,
    SpecDecoder,
    next_span,
    prefill_spans,
    split_spans,
)
from tests.conftest import BF16_CHUNKING

from .test_lossless import prompt_ids


@pytest.mark.parametrize("t", (1, 31, 32, 33, 100, 1000, 7836))
@pytest.mark.parametrize("chunk,pairs", ((128, None), (64, 1 << 16), (32, 1 << 12)))
def test_spans_cover_the_prompt_on_quantum_boundaries(t, chunk, pairs):
    spans = prefill_spans(t, chunk, pairs)
    assert spans[0][0] == 0 and spans[-1][1] == t
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(s % PREFILL_QUANTUM == 0 and 0 < e - s <= chunk for s, e in spans)
    for s, e in spans:  # the attention bound holds unless the chunk is already the smallest allowed
        assert pairs is None or (e - s) * (s + PREFILL_TOKEN_KEYS) <= pairs or e - s == min(PREFILL_QUANTUM, t - s)


def test_spans_shrink_as_the_prefix_grows():
    sizes = [e - s for s, e in prefill_spans(7836, 64, 1 << 16)]
    assert sizes[0] == 64 and sizes[-2] == PREFILL_QUANTUM  # 2^16 / 640 keys: 96 tokens, cut to 64
    assert all(a >= b for a, b in zip(sizes[:-1], sizes[1:-1], strict=False))  # the last one is the remainder


@pytest.mark.parametrize("chunk", (0, 4, 12, 100))
def test_bad_chunk_is_refused(chunk):
    with pytest.raises(ValueError, match="multiple of 8"):
        prefill_spans(100, chunk)


def test_long_spans_are_split_on_quantum_boundaries():
    assert list(split_spans([(0, 8), (8, 1100)], 512)) == [(0, 8), (8, 520), (520, 1032), (1032, 1100)]
    assert list(split_spans([(0, 512)], 512)) == [(0, 512)]
    assert EXACT_PREFILL_ROWS % PREFILL_QUANTUM == 0


@BF16_CHUNKING
@pytest.mark.parametrize("kind", ("llama", "qwen3"))
def test_bf16_exact_prefill_does_not_depend_on_the_chunking(tiny, kind, monkeypatch):
    """The cache bits and the first token are the same whatever the chunks (multi-block key lengths included)."""
    target = tiny.native(kind, seed=0, max_position_embeddings=2048).to(torch.bfloat16)
    prompt = prompt_ids(1100, seed=7)
    widest = []
    run = target.run
    monkeypatch.setattr(target, "run", lambda tokens, *a: (widest.append(tokens.shape[1]), run(tokens, *a))[1])
    ref = None
    for chunk, pairs in ((128, None), (32, None), (64, 1 << 15), (1024, None)):
        dec = SpecDecoder(target, None, DecodeConfig(max_new_tokens=4, exact=True))
        *_, seq = dec.prefill_steps(prompt, next_end=lambda s, t, c=chunk, p=pairs: next_span(s, t, c, p))
        got = (seq.cache.k[:, :, :, :1100].clone(), seq.cache.v[:, :, :, :1100].clone(), seq.history[-1].item())
        if ref is None:
            ref = got
            continue
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] == ref[2], chunk
    assert max(widest) == EXACT_PREFILL_ROWS  # the 1,024-token chunks were split (no [T, T] table past 512 rows)


def test_prefill_budget_steers_chunks_to_the_decode_time():
    budget = PrefillBudget(pairs=1 << 15)
    budget.observe(decode_s=0.05, chunk_s=0.2)  # chunk 4x too slow: halve (the most one step moves)
    assert budget.pairs == 1 << 14
    for _ in range(20):
        budget.observe(decode_s=0.05, chunk_s=0.025)  # too fast: grow, up to the cap
    assert budget.pairs == budget.most
    budget.observe(decode_s=0.05, chunk_s=0.05 / 0.8)
    assert budget.pairs == int(budget.most * 0.8)
