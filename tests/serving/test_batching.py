"""Continuous batching through the server: concurrency 8 changes no greedy token (fp32).

Eight clients send different chat prompts at once; every served answer must equal what
``Speculator.generate`` (batch 1, the library path) returns for the same prompt, and the
server must really have batched them (the running gauge goes above 1). A second server runs
the measured speculation policy ("auto", calibrated at start) and must stay lossless too.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI

MODEL = "smol"
PROMPTS = [
    "List three fruits.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Name a planet and one fact about it.",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat.",
    "Give a synonym for happy.",
    "Say hello in French and in Spanish.",
    "Count from one to eight in words.",
]


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


def _concurrent(url: str, max_tokens: int) -> tuple[dict[int, list[int]], float]:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    out: dict[int, list[int]] = {}
    peak = [0.0]

    def ask(i: int) -> None:
        msgs = [{"role": "user", "content": PROMPTS[i]}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0)
        out[i] = r.model_extra["eyas"]["token_ids"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], _gauge(url, "eyas:num_requests_running"))
        time.sleep(0.05)
    return out, peak[0]


@pytest.fixture(scope="module")
def references(spec):
    return {i: spec.generate([{"role": "user", "content": p}], max_new_tokens=20).token_ids
            for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_concurrency_8_equals_library(spec, launch, references, policy):
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    limits = ServeLimits(max_queue=16, max_tokens=64, max_batch=8, spec_policy=policy, calibrate=policy == "auto")
    url = launch(create_app(spec, MODEL, limits))
    got, peak = _concurrent(url, 20)
    assert peak > 1, "requests were not batched"
    for i in range(len(PROMPTS)):
        assert got[i] == references[i], PROMPTS[i]
    assert _gauge(url, "eyas:spec_decode_verify_width") >= 1
