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


def _ask_all(url: str, concurrency: int, speculate: bool, cached: list[int] | None = None) -> dict[int, list[int]]:
    """Token ids by prompt; ``cached`` collects each answer's prompt tokens from the prefix cache."""
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    out: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                           max_tokens=NEW, temperature=0, extra_body={"speculate": speculate})
        out[i] = r.model_extra["eyas"]["token_ids"]
        if cached is not None:
            cached.append(r.usage.prompt_tokens_details.cached_tokens)

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
    from eyas.kv.prefix import PrefixStore
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    spec = Speculator(bf16_target, DrafterSpec(drafter))
    spec.prefix_cache = PrefixStore()  # as eyas serve runs: the prompts share the chat template's system prompt
    limits = ServeLimits(max_queue=16, max_tokens=64, max_batch=8, spec_policy="auto", calibrate=False)
    url = launch(create_app(spec, MODEL, limits))
    cached: list[int] = []
    for concurrency in (1, 8):
        for speculate in (True, False):
            got = _ask_all(url, concurrency, speculate, cached)
            for i in range(len(PROMPTS)):
                assert got[i] == drafter_none_refs[i], (concurrency, speculate, PROMPTS[i])
    assert max(cached) > 0  # the cache was used: the answers above came partly from reused prompts


@pytest.mark.slow
def test_a_chats_later_turns_reuse_the_earlier_ones_and_keep_their_tokens(bf16_target, launch):
    """Turn n's prompt starts with turn n - 1's: the server prefills only the rest (usage reports the reused
    tokens as ``cached_tokens``, as OpenAI's API does) and answers what eyas generate answers without reuse."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.kv.prefix import PrefixStore
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    plain = Speculator(bf16_target, DrafterSpec("none"))
    spec = Speculator(bf16_target, DrafterSpec("default"))
    spec.prefix_cache = PrefixStore()
    url = launch(create_app(spec, MODEL, ServeLimits(max_tokens=64, spec_policy="always", calibrate=False)))
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages, previous = [], 0
    for turn in PROMPTS[:3]:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
        ids = r.model_extra["eyas"]["token_ids"]
        assert ids == plain.generate(messages, max_new_tokens=NEW).token_ids, len(messages)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert previous // 8 * 8 <= cached < r.usage.prompt_tokens, (cached, previous)
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
