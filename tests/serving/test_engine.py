"""Queue limit (429), cancellation on disconnect and failing requests, on a fake Speculator.

The fake decodes one token per step as slowly as the test wants, so timing-dependent paths
(a full queue, a client leaving mid-stream) are deterministic and need no model.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def fake(launch, fake_spec):
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    spec = fake_spec()
    url = launch(create_app(lambda: spec, "fake", ServeLimits(max_queue=1, max_tokens=10000, max_batch=1)))
    yield spec, url
    spec.gate.set()  # never leave the worker blocked at teardown


def _post(url, max_tokens=3, stream=False, timeout=30):
    return httpx.post(
        url + "/v1/completions",
        timeout=timeout,
        json={"model": "fake", "prompt": "p", "max_tokens": max_tokens, "stream": stream},
    )


def _running(url) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("eyas:num_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no running gauge")


def test_fake_roundtrip(fake):
    spec, url = fake
    d = _post(url).json()
    assert d["choices"][0]["text"] == "t1 t2 t3 " and d["usage"]["completion_tokens"] == 3
    assert (
        d["eyas"]["drafted"] == 4 and d["eyas"]["accepted"] == 2 and d["eyas"]["mean_accepted_length"] == 2.0
    )


def test_queue_full_is_429(fake):
    spec, url = fake
    spec.gate.clear()  # the worker blocks inside the first request
    results = []
    threads = [threading.Thread(target=lambda: results.append(_post(url))) for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 10
    while _running(url) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    threads[1].start()  # waits in the queue (max_queue=1)
    time.sleep(0.3)
    r = _post(url)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert "--max-queue" in err["message"] and "1 waiting" in err["message"] and err["code"] == "queue_full"
    spec.gate.set()
    for t in threads:
        t.join(30)
    assert [x.status_code for x in results] == [200, 200]


def test_disconnect_cancels(fake):
    spec, url = fake
    spec.delay, before = 0.01, spec.steps
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=30,
        json={"model": "fake", "prompt": "p", "max_tokens": 5000, "stream": True},
    ) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    time.sleep(0.5)
    stopped_at = spec.steps
    time.sleep(0.3)
    spec.delay = 0.0
    assert spec.steps == stopped_at < before + 1000, "the worker kept decoding after the client left"
    assert _post(url).status_code == 200  # the slot is free
    abort = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if 'finished_reason="abort"' in ln]
    assert abort and float(abort[0].split()[-1]) >= 1


def test_failure_is_500_and_server_stays_up(fake):
    spec, url = fake
    spec.fail = True
    try:
        r = _post(url)
    finally:
        spec.fail = False
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert _post(url).status_code == 200


def test_failure_on_v2_is_in_tritons_shape(fake):
    spec, url = fake
    body = {"text_input": "p", "parameters": {"max_tokens": 3}}
    spec.fail = True
    try:
        r = httpx.post(url + "/v2/models/fake/generate", json=body, timeout=30)
        with httpx.stream("POST", url + "/v2/models/fake/generate_stream", json=body, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
    finally:
        spec.fail = False
    assert r.status_code == 500 and "boom" in r.json()["error"]  # {"error": "..."}, not OpenAI's object
    assert len(events) == 1 and "boom" in json.loads(events[0][6:])["error"]
    assert httpx.post(url + "/v2/models/fake/generate", json=body, timeout=30).status_code == 200
