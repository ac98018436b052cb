"""FastAPI app: OpenAI (/v1), Triton generate (/v2), /health, /metrics and a chat page (/).

    app = create_app(eyas.load(drafter="ngram"), "smollm2")   # or a zero-argument factory
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every response carries the request's speculative statistics in an extra ``eyas`` field
(non-streaming bodies, and the last chunk of a stream); streamed content chunks also carry
their ``token_ids``, how many of them were drafted-and-accepted (``num_accepted``), and for
the page at ``/`` each token's text and mark (``pieces``, ``drafted``) and its ``step``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from eyas.api import Speculator
from eyas.serving.engine import Delta, Engine, Failure, Final, GenRequest, QueueFullError, ServeLimits
from eyas.serving.metrics import Metrics
from eyas.serving.pieces import TokenPieces
from eyas.serving.protocol import ApiError, ChatRequest, CompletionRequest, TritonRequest, parse

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATIC = Path(__file__).parent / "static"  # the chat page at / (index.html, app.js, style.css)


def create_app(
    speculator: Speculator | Callable[[], Speculator], model_name: str, limits: ServeLimits | None = None
) -> FastAPI:
    """An app serving ``speculator`` (or the one a factory builds at startup) as ``model_name``."""
    limits = limits or ServeLimits()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        spec = speculator if isinstance(speculator, Speculator) else speculator()
        state["server"] = Server(spec, model_name, limits)
        yield
        state["server"].engine.close()

    app = FastAPI(title="eyas", lifespan=lifespan)
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state["server"].metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/eyas/policy")
    async def policy() -> dict:
        """The speculation policy's measurements and choices (eyas.policy)."""
        return state["server"].policy_view()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state["server"].model_card()]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await state["server"].openai(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state["server"].openai(request, chat=False)

    @app.post("/v2/models/{name}/generate")
    async def generate(name: str, request: Request):
        return await state["server"].triton(name, request, stream=False)

    @app.post("/v2/models/{name}/generate_stream")
    async def generate_stream(name: str, request: Request):
        return await state["server"].triton(name, request, stream=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v2/"):  # Triton's error shape
            return JSONResponse({"error": e.message}, status_code=e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(e.errors()[0].get("msg"))).body(), status_code=400)


class Server:
    """Request handling: validation, limits, submission to the engine, response shapes."""

    def __init__(self, spec: Speculator, model_name: str, limits: ServeLimits) -> None:
        self.spec, self.model_name, self.limits = spec, model_name, limits
        self.metrics = Metrics()
        self.engine = Engine(spec, limits, self.metrics)
        self.context = spec.target.model.config.max_position_embeddings
        self.created = int(time.time())

    def policy_view(self) -> dict:
        policy, running = self.engine.batch.policy, self.metrics.running
        if policy is None:
            return {"mode": "none", "reason": "no drafter"}
        for _ in range(5):  # the engine thread may add a cost point while we read
            try:
                return {"running": running, **policy.snapshot(max(running, 1), self.limits.max_batch)}
            except RuntimeError:
                time.sleep(0.001)
        raise ApiError(503, "the policy is being updated; retry", None, "busy", "server_error")

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "eyas",
            "max_model_len": self.context,
        }

    # ---- OpenAI ----------------------------------------------------------------------------
    async def openai(self, request: Request, chat: bool):
        req = self._validated(ChatRequest if chat else CompletionRequest, await request.body())
        if req.model != self.model_name:
            self.metrics.observe_reject("invalid")
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist; this server serves "
                f"`{self.model_name}` (see GET /v1/models).",
                "model",
                "model_not_found",
            )
        prompt = [m.as_dict() for m in req.messages] if chat else req.text()
        default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        gen = self._submit(prompt, chat, req, req.token_limit(), default, "messages" if chat else "prompt")
        ids = _ids(
            "chatcmpl" if chat else "cmpl", self.model_name, "chat.completion" if chat else "text_completion"
        )
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(_openai_chunks(gen, request, ids, chat, usage, self.spec), gen)
        final = await _collect(gen, request)
        choice = {"index": 0, "logprobs": None, "finish_reason": final.finish_reason}
        choice.update(
            {"message": {"role": "assistant", "content": final.text}} if chat else {"text": final.text}
        )
        return {**ids, "choices": [choice], "usage": _usage(final), "eyas": _eyas(final)}

    # ---- Triton generate extension ----------------------------------------------------------
    async def triton(self, name: str, request: Request, stream: bool):
        if name != self.model_name:
            raise ApiError(
                404, f"Request for unknown model: '{name}' is not found (serving '{self.model_name}')"
            )
        req = self._validated(TritonRequest, await request.body())
        p = req.merged()
        gen = self._submit(
            req.text_input, False, p, p.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "text_input"
        )
        head = {"model_name": self.model_name, "model_version": "1"}
        if stream:
            return _sse(_triton_events(gen, request, head), gen, done=False)
        final = await _collect(gen, request)
        # like Triton's vLLM backend: the prompt is echoed unless exclude_input_in_output (not when streaming)
        text = final.text if p.exclude_input_in_output else req.text_input + final.text
        return {
            **head,
            "text_output": text,
            "finish_reason": final.finish_reason,
            "usage": _usage(final),
            "eyas": _eyas(final),
        }

    # ---- shared ------------------------------------------------------------------------------
    def _validated(self, model, body: bytes):
        try:
            return parse(model, body)
        except ApiError:
            self.metrics.observe_reject("invalid")
            raise

    def _submit(
        self, prompt, chat: bool, p, max_tokens: int | None, default: int | None, param: str
    ) -> GenRequest:
        """Encode, check the limits, queue. p: any object with temperature/top_p/top_k/seed/stop."""
        try:
            ids = self.spec.encode(prompt, chat=chat)
        except Exception as e:  # a template or tokenizer refusing the input is the client's problem
            raise ApiError(400, f"could not encode the {param}: {e}", param) from None
        n, limit = int(ids.shape[0]), self.limits.max_prompt_tokens or self.context
        if n > limit or n >= self.context:
            raise ApiError(
                400,
                f"The {param} is {n} tokens long; this server accepts at most "
                f"{min(limit, self.context - 1)} (--max-prompt-tokens / the model's context "
                f"of {self.context}).",
                param,
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > self.limits.max_tokens:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens}; this server allows at most "
                f"{self.limits.max_tokens} (--max-tokens-limit).",
                "max_tokens",
                "invalid_value",
            )
        room = self.context - n
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context} tokens; the {param} "
                f"has {n} and max_tokens asks for {max_tokens}. Lower max_tokens or shorten "
                f"the {param}.",
                "max_tokens",
                "context_length_exceeded",
            )
        max_new = max_tokens or min(default or self.limits.max_tokens, self.limits.max_tokens, room)
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        params = {
            "max_new_tokens": max_new,
            "temperature": p.temperature or 0.0,
            "top_p": p.top_p or 1.0,
            "top_k": max(p.top_k or 0, 0),
            "seed": p.seed,
            "speculate": p.speculate,
        }
        gen = GenRequest(ids=ids, params=params, stop=stop, loop=asyncio.get_running_loop())
        try:
            self.engine.submit(gen)
        except QueueFullError as e:
            raise ApiError(429, str(e), None, "queue_full", "rate_limit_error") from None
        return gen


def _ids(prefix: str, model: str, obj: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def _usage(final: Final) -> dict:
    n = len(final.token_ids)
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": final.prompt_tokens + n,
    }


def _eyas(final: Final) -> dict:
    return {**final.spec, "token_ids": final.token_ids}


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


async def _collect(gen: GenRequest, request: Request) -> Final:
    try:
        while not isinstance(item := await _next(gen, request), Final):
            pass
        return item
    finally:
        gen.cancel.set()  # no-op once finished; stops the worker if this task was cancelled


def _sse(events: AsyncIterator[dict], gen: GenRequest, done: bool = True) -> StreamingResponse:
    async def body():
        try:
            async for ev in events:
                yield f"data: {json.dumps(ev)}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            gen.cancel.set()  # client gone (the task is cancelled) or finished: free the worker
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _openai_chunks(
    gen: GenRequest, request: Request, ids: dict, chat: bool, usage: bool, spec: Speculator
):
    obj = {**ids, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if usage else {}

    def chunk(payload: dict, finish: str | None, stats: dict | None = None) -> dict:
        choice = {"index": 0, **payload, "logprobs": None, "finish_reason": finish}
        return {**obj, "choices": [choice], **extra, **({"eyas": stats} if stats else {})}

    if chat:
        yield chunk({"delta": {"role": "assistant", "content": ""}}, None)
    pieces, step, held = TokenPieces(spec.tokenizer), 0, None
    while not isinstance(item := await _next(gen, request), Final):
        info = _marks(item, pieces.push(item.token_ids), step)  # every step feeds ``pieces``
        step += 1
        info = info if held is None else _merge(held, info)
        if item.text:
            held = None
            yield chunk({"delta": {"content": item.text}} if chat else {"text": item.text}, None, info)
        else:  # text held back (a possible stop string, a partial character): its tokens ride along
            held = info
    yield chunk({"delta": {}} if chat else {"text": ""}, item.finish_reason, _eyas(item))
    if usage:
        yield {**obj, "choices": [], "usage": _usage(item)}


def _merge(held: dict, info: dict) -> dict:
    """One chunk's marks after a step whose text was held back: the held tokens come first."""
    out = {k: held[k] + info[k] for k in ("token_ids", "pieces", "drafted")}
    return {**info, **out, "num_accepted": held["num_accepted"] + info["num_accepted"]}


def _marks(item: Delta, pieces: list[str], step: int) -> dict:
    """A content chunk's ``eyas`` field: its tokens, which were drafted-and-accepted, their text.

    ``step`` counts the request's decoder steps (0: the prefill's token); ``pieces`` are the
    tokens' texts (``TokenPieces``), so a page can mark each token. Their concatenation may
    differ from the chunk's text, which is held back for stop strings and incomplete UTF-8.
    """
    n = item.num_accepted
    return {
        "token_ids": item.token_ids,
        "num_accepted": n,
        "pieces": pieces,
        "drafted": [i < n for i in range(len(item.token_ids))],
        "step": step,
    }


async def _triton_events(gen: GenRequest, request: Request, head: dict):
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
        "usage": _usage(item),
        "eyas": _eyas(item),
    }
