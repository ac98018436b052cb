"""Tokenizing training conversations: the batched path (load_examples) gives exactly the per-conversation one."""

from __future__ import annotations

import os

import pytest
import torch

from eyas.train import dataset
from eyas.train.dataset import load_examples, tokenize_conversation


def _convs() -> list[dict]:
    u, a, s = "user", "assistant", "system"
    return [
        {"id": "one", "messages": [{"role": u, "content": "Name three colours."},
                                   {"role": a, "content": "Red, green and blue."}]},
        {"id": "multi", "messages": [{"role": s, "content": "Be brief."}, {"role": u, "content": "2 + 2?"},
                                     {"role": a, "content": "4."}, {"role": u, "content": "And 3 + 3?"},
                                     {"role": a, "content": "6, which is twice 3."}]},
        {"id": "short", "messages": [{"role": u, "content": "Say ok."}, {"role": a, "content": "ok"}]},
        {"id": "long", "messages": [{"role": u, "content": "Count."},
                                    {"role": a, "content": " ".join(str(i) for i in range(200))}]},
    ]


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_batched_tokenization_equals_one_conversation_at_a_time(default_target, monkeypatch, chunk):
    tok = default_target.tokenizer
    monkeypatch.setattr(dataset, "CHUNK", chunk)  # conversations split across batch calls, or all in one
    convs = _convs()
    got = load_examples(None, tok, max_len=64, min_assistant=1, convs=convs)
    assert [e.id for e in got] == [c["id"] for c in convs]
    for ex, conv in zip(got, convs, strict=True):
        ref = tokenize_conversation(tok, conv["messages"], 64)
        assert torch.equal(ex.input_ids, ref.input_ids) and torch.equal(ex.loss_mask, ref.loss_mask)
    multi = got[1]
    # both answers are trained on, the user turn between them is not; "long" is cut at max_len
    text = tok.decode(multi.input_ids[1:][multi.loss_mask[:-1]])
    assert "4." in text and "twice 3" in text and "And 3 + 3" not in text
    assert got[3].input_ids.shape[0] == 64


def test_conversations_with_too_few_assistant_tokens_are_dropped(default_target):
    got = load_examples(None, default_target.tokenizer, max_len=64, min_assistant=4, convs=_convs())
    assert "short" not in [e.id for e in got] and "one" in [e.id for e in got]


class _Spy:
    """A tokenizer that records TOKENIZERS_PARALLELISM at each encode call."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *a, **kw):
        self.seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return self.tok(*a, **kw)


@pytest.mark.parametrize("before", ["false", None])
def test_batch_encode_uses_every_core_and_restores_the_setting(default_target, monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)  # what eyas's CLI sets
    monkeypatch.setattr(dataset, "CHUNK", 2)
    spy = _Spy(default_target.tokenizer)
    load_examples(None, spy, max_len=64, min_assistant=1, convs=_convs())
    assert spy.seen == ["true", "true"]  # two chunks, each encoded with the tokenizer's threads on
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before
