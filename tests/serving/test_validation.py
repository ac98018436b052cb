"""Bad input: >= 50 malformed requests all get a 4xx with an OpenAI-shaped error, the server stays up."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "smol"
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


LONG = "word " * 400  # > --max-prompt-tokens 256 of the test server

# (path, body: bytes sent as-is or a JSON-able object, expected status, word the message must contain)
CASES = [
    (CHAT, b"", 400, "JSON"),
    (CHAT, b"{", 400, "JSON"),
    (CHAT, b"{'model': 1}", 400, "JSON"),
    (CHAT, b"not json", 400, "JSON"),
    (CHAT, b"\xff\xfe", 400, "JSON"),
    (CHAT, b"[]", 400, "object"),
    (CHAT, b"null", 400, "object"),
    (CHAT, b"42", 400, "object"),
    (CHAT, b'"x"', 400, "object"),
    (CHAT, {}, 400, "model"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"messages": MSG}, 400, "model"),
    (CHAT, chat(model="gpt-4"), 404, "gpt-4"),
    (CHAT, chat(model=5), 400, "model"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "content"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "role"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "content",
    ),
    (CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "256"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=2.5), 400, "max_tokens"),
    (CHAT, chat(max_tokens=10**6), 400, "max-tokens-limit"),
    (CHAT, chat(max_tokens=65), 400, "64"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=-0.1), 400, "temperature"),
    (CHAT, chat(temperature=2.5), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_p=-1), 400, "top_p"),
    (CHAT, chat(top_k=-2), 400, "top_k"),
    (CHAT, chat(top_k=1.5), 400, "top_k"),
    (CHAT, chat(seed="abc"), 400, "seed"),
    (CHAT, chat(n=2), 400, "n"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream=1), 400, "stream"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(stop=[1]), 400, "stop"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "y"}), 400, "include_usage"),
    (CHAT, chat(frobnicate=True), 400, "frobnicate"),
    (CHAT, chat(presence_penalty=1.0), 400, "presence_penalty"),
    (CHAT, chat(logit_bias={"1": 5}), 400, "logit_bias"),
    (CHAT, chat(logprobs=True), 400, "logprobs"),
    (COMP, {"model": MODEL}, 400, "prompt"),
    (COMP, comp(prompt=""), 400, "prompt"),
    (COMP, comp(prompt=[]), 400, "prompt"),
    (COMP, comp(prompt=["a", "b"]), 400, "prompt"),
    (COMP, comp(prompt=[1, 2, 3]), 400, "prompt"),
    (COMP, comp(prompt=LONG), 400, "256"),
    (COMP, comp(model="other"), 404, "other"),
    (COMP, comp(echo=True), 400, "echo"),
    (COMP, comp(best_of=3), 400, "best_of"),
    (COMP, comp(temperature=None, top_p="1"), 400, "top_p"),
    (COMP, comp(max_tokens=None, prompt="x", suffix="y"), 400, "suffix"),
    ("/v1/nothing", comp(), 404, "Not Found"),
]


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def test_enough_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("path,body,status,word", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_malformed_request(http, path, body, status, word):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and word in err["message"], err


def test_good_request_after_bad_ones(http, client):
    r = http.post(CHAT, content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1


def test_openai_client_sees_bad_request(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MSG)
