"""Hostile and careless requests: >= 300 cases, each a 4xx with a message in its route's error shape.

OpenAI's shape on /v1 (``{"error": {"message", "type", "param", "code"}}``), Triton's on /v2
(``{"error": "message"}``). Cases run in bursts; after each burst a good request is served.
Issue 14's defects are here: Triton ``stop_words`` (>4, "") and ``seed`` >= 2**63 were 500s,
duplicate keys and ``stop: ""`` were accepted, /v2 mixed two shapes, bodies were unbounded.
The server is the shared test server (fp32, ngram, --max-prompt-tokens 256, --max-tokens-limit 64).
"""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "smol"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
GEN, GENS = f"/v2/models/{MODEL}/generate", f"/v2/models/{MODEL}/generate_stream"
MSG = [{"role": "user", "content": "hi"}]
BASE = {
    CHAT: {"model": MODEL, "messages": MSG, "max_tokens": 2},
    COMP: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    GEN: {"text_input": "hi", "parameters": {"max_tokens": 2}},
    GENS: {"text_input": "hi", "parameters": {"max_tokens": 2}},
}
BURST = 25

# field -> bad values; the field's name must appear in the message
SAMPLING_BAD = {
    "max_tokens": [0, -1, "5", 2.5, True, [], {}, 10**6, 65, 2**63],
    "temperature": [-0.1, 2.01, "hot", [], True, {}],
    "top_p": [0, 1.01, -1, "1", [], False],
    "top_k": [-2, 1.5, "3", True, []],
    "seed": [2**63, 2**64, -(2**63) - 1, 10**30, "1", 1.5, True, []],
    "stop": ["", [""], ["a", ""], ["a", "b", "c", "d", "e"], 5, [1], {"a": 1}, [["a"]], True],
    "speculate": ["no", 0, None, []],
}
OPENAI_BAD = {
    "model": [5, None, [], {}, True],
    "n": [2, 0, "1"],
    "stream": ["yes", 1, []],
    "user": [5, []],
    "presence_penalty": [1.0, "x"],
    "frequency_penalty": [0.5],
    "logit_bias": [{"1": 5}, "x"],
    "stream_options": [{"include_usage": True}, {"include_usage": "y"}, "x", {"frob": True}],
}
CHAT_BAD = {
    "messages": [[], "hi", None, 5, [{}], [{"role": "user"}], [{"content": "hi"}], [{"role": "wizard", "content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": "x", "extra": 1}],
                 [{"role": "user", "content": "x", "name": 5}], ["hi"], [[]]],
    "max_completion_tokens": [0, "3", 10**6],
    "logprobs": [True, 5],
    "metadata": [{"a": 1}, "x"],
    "store": ["yes"],
}
COMP_BAD = {
    "prompt": ["", [], ["a", "b"], [1, 2, 3], 5, None, {"x": 1}, [""]],
    "echo": [True],
    "best_of": [3, 0],
    "suffix": ["y"],
    "logprobs": [1],
}
TRITON_BAD = {  # inside "parameters"
    "max_tokens": [0, "5", 10**6],
    "exclude_input_in_output": ["yes", 1],
    "stream": ["yes"],
}
TRITON_TOP_BAD = {  # top-level fields (TensorRT-LLM ensembles send these)
    "text_input": ["", 5, None, [], {}],
    "parameters": ["x", [], 5],
    "stop_words": [["a", "b", "c", "d", "e"], "", [""], 5, [1], ["x", ""]],
    "bad_words": ["x", ["a"]],
    "max_tokens": [0, "5"],
    "seed": [2**63, "1"],
    "temperature": [-1],
    "frobnicate": [1],
}
LONG = "word " * 400  # > 256 tokens
HUGE = "x" * 40_000  # longer than 256 tokens of the longest token: refused before tokenising
RAW = [  # (body bytes, needle)
    (b"", "JSON"),
    (b"{", "JSON"),
    (b"not json", "JSON"),
    (b"{'model': 1}", "JSON"),
    (b"\xff\xfe", "JSON"),
    (b"[]", "object"),
    (b"null", "object"),
    (b"42", "object"),
    (b'"x"', "object"),
    (b"[" * 5000 + b"]" * 5000, "JSON"),
    (b'{"a": NaN}', "JSON"),
    (b'{"a": -Infinity}', "JSON"),
    (b"{} trailing", "JSON"),
    (b'{"text_input": "hi", "model": "smol", "prompt": "hi", "messages": []} {}', "JSON"),  # two documents
    (b'{"a": 1,}', "JSON"),
]


def _dump(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _dup(body: dict, key: str) -> bytes:
    """``body`` with ``key`` sent twice (the second time with the same, valid, value)."""
    text = json.dumps(body)
    return ("{" + json.dumps(key) + ": " + json.dumps(body[key]) + ", " + text[1:]).encode()


def _cases() -> list[tuple]:
    """(path, body, content-type or None, expected status, needle)."""
    out = []
    for path in (CHAT, COMP):
        for table in (SAMPLING_BAD, OPENAI_BAD, CHAT_BAD if path == CHAT else COMP_BAD):
            for name, values in table.items():
                out += [(path, {**BASE[path], name: v}, "application/json", 400, name) for v in values]
        out += [(path, {**BASE[path], "model": m}, "application/json", 404, m) for m in ("gpt-4", "", "SMOL")]
        out += [(path, {**BASE[path], "frobnicate": 1}, "application/json", 400, "frobnicate")]
        out += [(path, _dup(BASE[path], k), "application/json", 400, "Duplicate key") for k in BASE[path]]
    for path in (GEN, GENS):
        for name, values in {**SAMPLING_BAD, **TRITON_BAD}.items():
            for v in values:
                out.append((path, {**BASE[path], "parameters": {name: v}}, "application/json", 400, name))
        for name, values in TRITON_TOP_BAD.items():
            out += [(path, {**BASE[path], name: v}, "application/json", 400, name) for v in values]
        out += [(path, _dup(BASE[path], k), "application/json", 400, "Duplicate key") for k in BASE[path]]
        out.append((path, {"text_input": LONG}, "application/json", 400, "256"))
        out.append((path, {"text_input": HUGE}, "application/json", 400, "at least"))
        out.append((path.replace(f"/{MODEL}/", "/other/"), BASE[path], "application/json", 404, "other"))
    out.append((CHAT, {**BASE[CHAT], "messages": [{"role": "user", "content": LONG}]}, "application/json", 400,
                "messages (chat template applied) are"))
    out.append((CHAT, {**BASE[CHAT], "messages": [{"role": "user", "content": HUGE}]}, "application/json", 400,
                "at least"))
    out.append((COMP, {**BASE[COMP], "prompt": LONG}, "application/json", 400, "prompt is"))
    for path in BASE:
        out += [(path, body, "application/json", 400, needle) for body, needle in RAW]
        out += [(path, _dump(BASE[path]) + tail, "application/json", 400, "JSON") for tail in (b" x", b"{}", b"\x00")]
        out += [(path, BASE[path], ctype, 415, "application/json") for ctype in (None, "text/plain", "text/html")]
        out.append((path, b"{" + b" " * (3 << 20) + b"}", "application/json", 413, "--max-body-bytes"))
    out += [("/v1/nothing", BASE[COMP], "application/json", 404, "Not Found"),
            ("/v2/models/smol/nothing", BASE[GEN], "application/json", 404, "Not Found"),
            ("/v2/nothing", BASE[GEN], "application/json", 404, "Not Found")]
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def test_at_least_300_cases():
    assert len(CASES) >= 300, len(CASES)


def _assert_shape(path: str, r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    if path.startswith("/v2/"):  # Triton: one string, on every /v2 error
        assert isinstance(err, str) and needle in err, err
    else:
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and needle in err["message"], err


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{i}:{c[0].split('/')[-1]}" for i, c in enumerate(CASES)])
def test_bad_request_is_4xx_in_the_route_shape(http, i):
    path, body, ctype, status, needle = CASES[i]
    headers = {"content-type": ctype} if ctype else {}
    _assert_shape(path, http.post(path, content=_dump(body), headers=headers), status, needle)
    if i % BURST == BURST - 1 or i == len(CASES) - 1:  # after each burst, a good request is served
        r = http.post(COMP, json={**BASE[COMP], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("path", list(BASE))
def test_wrong_method_is_405_in_the_route_shape(http, method, path):
    _assert_shape(path, http.request(method, path), 405, "Method Not Allowed")


def test_generate_stream_refuses_before_streaming(http):
    """A bad seed on generate_stream is an HTTP 400, not a 200 stream carrying an error event."""
    r = http.post(GENS, json={"text_input": "hi", "parameters": {"seed": 2**63, "stream": True}})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "seed" in r.json()["error"]


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_extreme_valid_seeds_are_served(http, seed):
    r = http.post(COMP, json={**BASE[COMP], "seed": seed, "temperature": 0.8})
    assert r.status_code == 200, r.text
    r = http.post(GEN, json={"text_input": "hi", "parameters": {"seed": seed, "temperature": 0.8, "max_tokens": 2}})
    assert r.status_code == 200, r.text


def test_triton_top_level_stop_words_are_applied(http):
    r = http.post(GEN, json={"text_input": "hi", "stop_words": ["a", "b", "c", "d"], "parameters": {"max_tokens": 2}})
    assert r.status_code == 200, r.text
