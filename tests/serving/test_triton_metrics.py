"""Triton's generate extension over plain HTTP, and the Prometheus /metrics endpoint."""

from __future__ import annotations

import json
import re

import httpx

MODEL = "smol"


def _metrics(base_url) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?", name), line
            out[name] = float(value)
    return out


def test_generate(base_url, spec):
    body = {"text_input": "The sky is", "parameters": {"max_tokens": 8, "temperature": 0}}
    r = httpx.post(f"{base_url}/v2/models/{MODEL}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = spec.generate("The sky is", chat=False, max_new_tokens=8)
    d = r.json()
    assert d["model_name"] == MODEL and d["text_output"] == "The sky is" + ref.text
    assert d["eyas"]["token_ids"] == ref.token_ids
    body["parameters"]["exclude_input_in_output"] = True
    assert (
        httpx.post(f"{base_url}/v2/models/{MODEL}/generate", json=body, timeout=60).json()["text_output"]
        == ref.text
    )


def test_generate_stream(base_url, spec):
    body = {"text_input": "The sky is", "parameters": {"max_tokens": 8, "stream": True}}
    with httpx.stream("POST", f"{base_url}/v2/models/{MODEL}/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    ref = spec.generate("The sky is", chat=False, max_new_tokens=8)
    assert "".join(e["text_output"] for e in events) == ref.text
    assert all(e["model_name"] == MODEL for e in events)
    assert events[-1]["finish_reason"] in ("stop", "length")


def test_triton_errors(base_url):
    r = httpx.post(f"{base_url}/v2/models/nope/generate", json={"text_input": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.post(
        f"{base_url}/v2/models/{MODEL}/generate", json={"text_input": "x", "parameters": {"top_p": 0}}
    )
    assert r.status_code == 400 and "top_p" in r.json()["error"]


def test_metrics_move(base_url, client):
    before = _metrics(base_url)
    client.completions.create(model=MODEL, prompt="a b c a b c a b c a b", max_tokens=8)
    after = _metrics(base_url)
    for name in (
        "eyas:prompt_tokens_total",
        "eyas:prefix_cache_queries_total",
        "eyas:generation_tokens_total",
        "eyas:spec_decode_num_drafts_total",
        "eyas:time_to_first_token_seconds_count",
        "eyas:inter_token_latency_seconds_count",
    ):
        assert after[name] > before.get(name, 0), name
    assert (
        after["eyas:spec_decode_num_draft_tokens_total"]
        >= after["eyas:spec_decode_num_accepted_tokens_total"]
    )
    assert 0 <= after["eyas:prefix_cache_hits_total"] <= after["eyas:prefix_cache_queries_total"]
    per_pos = sum(v for k, v in after.items() if k.startswith("eyas:spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == after["eyas:spec_decode_num_accepted_tokens_total"]
    assert (
        after['eyas:time_to_first_token_seconds_bucket{le="+Inf"}']
        == after["eyas:time_to_first_token_seconds_count"]
    )
