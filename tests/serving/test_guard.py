"""What a request passes before any work (eyas.serving.guard), on a model-free fake server.

API key (401 in the route's shape), application/json only (415), a body limit (413 naming it),
a body that never completes (408, connection closed) and tokenisation off the event loop.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "sekrit-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1000


@pytest.fixture(scope="module")
def guarded(launch, fake_spec):
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits
    from eyas.serving.guard import HttpConfig

    spec = fake_spec()
    http = HttpConfig(max_body_bytes=LIMIT, body_timeout_s=0.5, api_key=KEY)
    url = launch(create_app(lambda: spec, "fake", ServeLimits(max_tokens=100, max_batch=2), http))
    yield spec, url
    spec.encode_delay = 0.0


def _body(**kw) -> dict:
    return {"model": "fake", "prompt": "p", "max_tokens": 2, **kw}


def _post(url: str, path: str = "/v1/completions", headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(url + path, headers={**AUTH, **(headers or {})}, timeout=30, **kw)


# ---- API key ----------------------------------------------------------------------------------
BAD_AUTH = [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer", f"Bearer  {KEY}"]


@pytest.mark.parametrize("auth", BAD_AUTH)
def test_missing_or_wrong_key_is_401_openai_shape(guarded, auth):
    _, url = guarded
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.post(url + "/v1/completions", json=_body(), headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"], err


def test_key_protects_v1_and_v2_but_not_health_metrics_or_page(guarded):
    _, url = guarded
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/eyas/policy").status_code == 401
    r = httpx.post(url + "/v2/models/fake/generate", json={"text_input": "x"})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)  # Triton's shape on /v2
    for path in ("/health", "/metrics", "/", "/static/app.js"):
        assert httpx.get(url + path).status_code == 200, path
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200


def test_openai_client_with_the_key(guarded):
    openai = pytest.importorskip("openai")
    _, url = guarded
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert ok.completions.create(model="fake", prompt="p", max_tokens=2).choices[0].text == "t1 t2 "
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="fake", prompt="p", max_tokens=2)


# ---- content type -----------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonx", "text/json"])
def test_json_endpoints_require_application_json(guarded, ctype):
    _, url = guarded
    headers = {} if ctype is None else {"Content-Type": ctype}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _post(url, path, headers=headers, content=json.dumps(_body()).encode())
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["error"]["message"]
    r = _post(url, "/v2/models/fake/generate", headers=headers, content=b'{"text_input": "x"}')
    assert r.status_code == 415 and "application/json" in r.json()["error"]


def test_json_with_charset_is_accepted(guarded):
    _, url = guarded
    r = _post(url, headers={"Content-Type": "Application/JSON; charset=utf-8"}, content=json.dumps(_body()))
    assert r.status_code == 200, r.text


# ---- body size and time -----------------------------------------------------------------------
def test_body_over_the_limit_is_413_naming_it(guarded):
    _, url = guarded
    big = _body(prompt="x" * (2 * LIMIT))
    r = _post(url, json=big)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"], r.text
    assert "--max-body-bytes" in r.json()["error"]["message"]
    r = _post(url, "/v2/models/fake/generate_stream", json={"text_input": "x" * (2 * LIMIT)})
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]


def test_chunked_body_over_the_limit_is_413(guarded):
    _, url = guarded

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "fake", "prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    r = _post(url, headers={"Content-Type": "application/json"}, content=chunks())
    assert r.status_code == 413, r.text
    assert _post(url, json=_body()).status_code == 200  # the server is fine


def test_short_body_times_out_with_408_and_closes(guarded):
    _, url = guarded
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"model": "fake"'  # 16 of the 100 bytes promised
        )
        t0, data = time.monotonic(), b""
        while chunk := s.recv(4096):  # until the server closes the connection
            data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"--body-timeout" in data and time.monotonic() - t0 < 8


# ---- work off the event loop ------------------------------------------------------------------
def test_tokenisation_does_not_block_the_event_loop(guarded):
    spec, url = guarded
    spec.encode_delay = 2.0  # a huge prompt or a slow chat template
    results = []
    t = threading.Thread(target=lambda: results.append(_post(url, json=_body())))
    t.start()
    time.sleep(0.3)  # the request is encoding now
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    waited = time.monotonic() - t0
    t.join(30)
    spec.encode_delay = 0.0
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenisation"
    assert results[0].status_code == 200
