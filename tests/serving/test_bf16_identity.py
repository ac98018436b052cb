"""One text for one request, whatever the route (bf16, exact mode on, the embedded default).

Served answers with ``speculate`` true and false, at concurrency 1 and 8, must equal what
``eyas generate --drafter none`` produces (``Speculator`` with no drafter) token for token.
"""

from __future__ import annotations

import threading

import pytest
from openai import OpenAI

from .test_batching import MODEL, PROMPTS

NEW = 24


@pytest.fixture(scope="module")
def bf16_target(default_target):
    from eyas.models.loading import load_target

    return load_target(None, "bfloat16")


@pytest.fixture(scope="module")
def drafter_none_refs(bf16_target):
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    plain = Speculator(bf16_target, DrafterSpec("none"))
    assert plain.exact
    return {i: plain.generate([{"role": "user", "content": p}], max_new_tokens=NEW).token_ids
            for i, p in enumerate(PROMPTS)}


def _ask_all(url: str, concurrency: int, speculate: bool) -> dict[int, list[int]]:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    out: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                           max_tokens=NEW, temperature=0, extra_body={"speculate": speculate})
        out[i] = r.model_extra["eyas"]["token_ids"]

    for lo in range(0, len(PROMPTS), concurrency):
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(lo, min(lo + concurrency, len(PROMPTS)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "default"])
def test_served_bf16_with_and_without_speculation_equals_drafter_none(bf16_target, drafter_none_refs, launch,
                                                                         drafter):
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    spec = Speculator(bf16_target, DrafterSpec(drafter))
    limits = ServeLimits(max_queue=16, max_tokens=64, max_batch=8, spec_policy="auto", calibrate=False)
    url = launch(create_app(spec, MODEL, limits))
    for concurrency in (1, 8):
        for speculate in (True, False):
            got = _ask_all(url, concurrency, speculate)
            for i in range(len(PROMPTS)):
                assert got[i] == drafter_none_refs[i], (concurrency, speculate, PROMPTS[i])
