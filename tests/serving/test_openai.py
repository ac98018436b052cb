"""The OpenAI endpoints through the real ``openai`` client, and fidelity to ``Speculator.generate``."""

from __future__ import annotations

import httpx
import pytest

MODEL = "smol"
MESSAGES = [{"role": "user", "content": "List the numbers from one to five."}]


def test_health_and_models(base_url, client):
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_equals_library(client, spec):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    ref = spec.generate(MESSAGES, max_new_tokens=12)
    stats = out.model_extra["eyas"]
    assert stats["token_ids"] == ref.token_ids
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == ref.prompt_tokens
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.choices[0].finish_reason == ("length" if len(ref.token_ids) == 12 else "stop")
    assert (stats["drafted"], stats["accepted"], stats["steps"]) == (ref.drafted, ref.accepted, ref.steps)
    assert stats["mean_accepted_length"] == pytest.approx(ref.mean_accepted, abs=1e-3)
    assert stats["accepted_per_position"] == ref.accepted_per_pos


def test_completion_seeded_sampling_equals_library(client, spec):
    prompt = "The capital of France is"
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 50},
    )
    ref = spec.generate(prompt, chat=False, max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    assert out.model_extra["eyas"]["token_ids"] == ref.token_ids
    assert out.choices[0].text == ref.text
    assert out.object == "text_completion"


def test_chat_stream_chunks(client, spec):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    ref = spec.generate(MESSAGES, max_new_tokens=12)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert [c.choices[0].finish_reason for c in body[:-1]] == [None] * (len(body) - 1)
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    marks = [c.model_extra["eyas"] for c in body[1:-1]]  # content chunks: their tokens and accepted count
    streamed = [t for m in marks for t in m["token_ids"]]
    assert streamed == ref.token_ids[: len(streamed)]
    assert sum(m["num_accepted"] for m in marks) <= ref.accepted
    assert body[-1].model_extra["eyas"]["token_ids"] == ref.token_ids
    # the page's marking: each token's text and whether it was drafted-and-accepted, per step
    assert "".join(p for m in marks for p in m["pieces"]) == ref.text  # plain ASCII: nothing held back
    for m in marks:
        assert len(m["pieces"]) == len(m["token_ids"])
        assert m["drafted"] == [i < m["num_accepted"] for i in range(len(m["token_ids"]))]
    steps = [m["step"] for m in marks]
    assert steps[0] == 0 and steps == sorted(set(steps))  # 0: the prefill's token


def test_completion_stream_and_sse_framing(base_url, client):
    chunks = list(
        client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, stream=True)
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with httpx.stream(
        "POST",
        base_url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, spec, stream):
    prompt = "One, two, three, four, five, six, seven,"
    full = spec.generate(prompt, chat=False, max_new_tokens=12).text
    assert len(full) >= 6, full
    stop = full[3:5]  # the server cuts at its first occurrence, as str.index finds it
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop, "zzzz"], temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == full[: full.index(stop)] and finish == "stop"


def test_speculate_false_decodes_plainly(client, spec):
    """The eyas extension field ``speculate: false`` turns drafting off for one request; same text."""
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    on = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    off = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0, extra_body={"speculate": False}
    )
    assert off.choices[0].message.content == on.choices[0].message.content
    assert off.model_extra["eyas"]["drafted"] == 0
    assert on.model_extra["eyas"]["drafted"] > 0


def test_held_back_tokens_reach_a_chunk(client):
    """A long stop string holds text back for several steps; no token id is lost from the chunks."""
    stream = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0, stop=["zzzzzzzzzz"], stream=True
    )
    chunks = list(stream)
    streamed = [t for c in chunks[:-1] for t in c.model_extra["eyas"]["token_ids"]]
    assert streamed == chunks[-1].model_extra["eyas"]["token_ids"]
    assert "".join(c.choices[0].text for c in chunks) != ""
