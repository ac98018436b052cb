"""The HTTP side of `eyas bench load`: streaming requests, closed-loop concurrency, SSE parsing.

httpx directly rather than the openai client: the benchmark needs each chunk's arrival time,
the raw error bodies, and to tell a stream that ended with ``[DONE]`` from one cut short.
Only timestamps and raw text are recorded while requests are in flight; tokens are counted
after the level (``load.count_tokens``) so tokenizer work never delays a measurement.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from eyas.bench.load_stats import Chunk, RequestRecord

if TYPE_CHECKING:
    from eyas.bench.load import LoadConfig


@dataclass
class Side:
    """One measured configuration: where requests go and whether the drafter is on."""

    label: str  # "default", "speculative" or "plain"
    url: str  # base URL, no /v1
    model: str
    speculate: bool | None  # the eyas request field `speculate`; None: not sent


def request_body(cfg: LoadConfig, side: Side, prompt: str) -> dict:
    """A streaming chat (or text) completion asking for usage in the last chunk."""
    body = {
        "model": side.model,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    if side.speculate is not None:
        body["speculate"] = side.speculate
    return body


async def measure_level(
    cfg: LoadConfig, side: Side, concurrency: int, prompts: list[str], n: int, bar=None
) -> list[RequestRecord]:
    """``n`` requests with exactly ``min(concurrency, n)`` in flight; prompts cycle from the first.

    bar: optional progress bar, advanced once per finished request.
    """
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    records: list[RequestRecord] = []
    todo = iter(range(n))  # shared by the workers: one event loop thread, so no lock is needed

    async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits) as client:

        async def worker() -> None:
            for i in todo:  # closed loop: the next request leaves when this worker's previous one ends
                rec = RequestRecord(index=i, prompt_index=i % len(prompts))
                records.append(rec)
                body = request_body(cfg, side, prompts[rec.prompt_index])
                await stream_request(client, side.url + path, body, rec, cfg.endpoint == "chat")
                if bar is not None:
                    bar.update()

        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return sorted(records, key=lambda r: r.index)


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, chat: bool
) -> None:
    """Send one streaming request and fill ``rec``; any failure lands in ``rec.error``."""
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = _http_error(resp.status_code, await resp.aread())
                return
            done = await _read_stream(resp, rec, chat)
        if rec.error is None and not done:
            rec.error = "stream ended without [DONE]"
        elif rec.error is None and rec.finish_reason is None:
            rec.error = "stream ended without a finish_reason"
    except (httpx.HTTPError, ValueError) as e:  # transport failures, timeouts, malformed JSON events
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.latency = time.perf_counter() - rec.start


async def _read_stream(resp: httpx.Response, rec: RequestRecord, chat: bool) -> bool:
    """Consume the SSE body into ``rec``; True when ``[DONE]`` arrived."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: lines
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return True
        _on_event(json.loads(payload), rec, chat, time.perf_counter() - rec.start)
    return False


def _on_event(obj: dict, rec: RequestRecord, chat: bool, t: float) -> None:
    """One SSE event: an error, content, the finish chunk (eyas stats) or the usage chunk."""
    if not isinstance(obj, dict):
        raise ValueError(f"unexpected stream event {obj!r:.200}")
    if obj.get("error") is not None:
        err = obj["error"]
        rec.error = rec.error or "error event: " + str(
            err.get("message", err) if isinstance(err, dict) else err
        )
        return
    if obj.get("usage"):
        rec.prompt_tokens = obj["usage"].get("prompt_tokens")
        rec.completion_tokens = obj["usage"].get("completion_tokens")
    stats = obj.get("eyas") if isinstance(obj.get("eyas"), dict) else None
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        finish = choice.get("finish_reason")
        if text:
            ids = stats.get("token_ids") if stats and not finish else None  # finish chunk: the whole answer's
            rec.chunks.append(Chunk(t, text, len(ids) if isinstance(ids, list) else None))
        if finish:
            rec.finish_reason = finish
            if stats:
                rec.spec = {k: v for k, v in stats.items() if k != "token_ids"}


def _http_error(status: int, body: bytes) -> str:
    """'HTTP 404: message' from an OpenAI-style error body, else its first 200 characters."""
    text = body.decode(errors="replace")
    try:
        err = json.loads(text).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {status}: {msg or text[:200]}"
