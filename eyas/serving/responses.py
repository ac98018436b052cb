"""Response shapes: OpenAI (chat and text completions, streamed or not) and Triton generate events.

Streamed content chunks carry, in an ``eyas`` field, their ``token_ids``, how many of them were
drafted-and-accepted (``num_accepted``), and for the page at ``/`` each token's text and mark
(``pieces``, ``drafted``) and its ``step``; the last chunk carries the request's statistics.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from eyas.serving.engine import Delta, Failure, Final, GenRequest
from eyas.serving.protocol import ApiError


def ids_of(prefix: str, model: str, obj: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def usage(final: Final) -> dict:
    n = len(final.token_ids)
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": final.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def eyas_field(final: Final) -> dict:
    return {**final.spec, "token_ids": final.token_ids, "prompt_tokens": final.prompt_tokens,
            "cached_tokens": final.cached_tokens}


async def _next(gen: GenRequest, request: Request) -> Delta | Final:
    """The next engine item; a client gone while waiting cancels the request."""
    while True:
        try:
            item = await asyncio.wait_for(gen.out.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                gen.cancel.set()
                raise asyncio.CancelledError from None
            continue
        if isinstance(item, Failure):
            raise ApiError(500, item.message, None, "generation_failed", "server_error")
        return item


async def collect(gen: GenRequest, request: Request) -> Final:
    try:
        while not isinstance(item := await _next(gen, request), Final):
            pass
        return item
    finally:
        gen.cancel.set()  # no-op once finished; stops the worker if this task was cancelled


def sse(events: AsyncIterator[dict], gen: GenRequest, triton: bool = False) -> StreamingResponse:
    """Server-sent events; an error after the stream started is a last event in the route's shape.

    OpenAI streams end with ``data: [DONE]``, Triton's (``triton``) do not.
    """

    async def body():
        try:
            async for ev in events:
                yield f"data: {json.dumps(ev)}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.triton_body() if triton else e.body())}\n\n"
        finally:
            gen.cancel.set()  # client gone (the task is cancelled) or finished: free the worker
        if not triton:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def openai_chunks(gen: GenRequest, request: Request, ids: dict, chat: bool, include_usage: bool):
    obj = {**ids, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    def chunk(payload: dict, finish: str | None, stats: dict | None = None) -> dict:
        choice = {"index": 0, **payload, "logprobs": None, "finish_reason": finish}
        return {**obj, "choices": [choice], **extra, **({"eyas": stats} if stats else {})}

    if chat:
        yield chunk({"delta": {"role": "assistant", "content": ""}}, None)
    step, held = 0, None
    while not isinstance(item := await _next(gen, request), Final):
        info = _marks(item, step)
        step += 1
        info = info if held is None else _merge(held, info)
        if item.text:
            held = None
            yield chunk({"delta": {"content": item.text}} if chat else {"text": item.text}, None, info)
        else:  # text held back (a possible stop string, a partial character): its tokens ride along
            held = info
    yield chunk({"delta": {}} if chat else {"text": ""}, item.finish_reason, eyas_field(item))
    if include_usage:
        yield {**obj, "choices": [], "usage": usage(item)}


def _merge(held: dict, info: dict) -> dict:
    """One chunk's marks after a step whose text was held back: the held tokens come first."""
    out = {k: held[k] + info[k] for k in ("token_ids", "pieces", "drafted")}
    return {**info, **out, "num_accepted": held["num_accepted"] + info["num_accepted"]}


def _marks(item: Delta, step: int) -> dict:
    """A content chunk's ``eyas`` field: its tokens, which were drafted-and-accepted, their text.

    ``step`` counts the request's decoder steps (0: the prefill's token); ``pieces`` are the
    tokens' texts (``eyas.detok``), so a page can mark each token. Their concatenation may
    differ from the chunk's text, which is held back for stop strings and incomplete UTF-8.
    """
    n = item.num_accepted
    return {
        "token_ids": item.token_ids,
        "num_accepted": n,
        "pieces": item.pieces,
        "drafted": [i < n for i in range(len(item.token_ids))],
        "step": step,
    }


async def triton_events(gen: GenRequest, request: Request, head: dict):
    while not isinstance(item := await _next(gen, request), Final):
        if item.text:
            yield {
                **head,
                "text_output": item.text,
                "token_ids": item.token_ids,
                "num_accepted": item.num_accepted,
            }
    yield {
        **head,
        "text_output": "",
        "finish_reason": item.finish_reason,
        "usage": usage(item),
        "eyas": eyas_field(item),
    }
