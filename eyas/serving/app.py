"""FastAPI app: OpenAI (/v1), Triton generate (/v2), /health, /metrics and a chat page (/).

    app = create_app(eyas.load(drafter="ngram"), "smollm2")   # or a zero-argument factory
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every response carries the request's speculative statistics in an extra ``eyas`` field
(``eyas.serving.responses``). Before any work a request passes ``eyas.serving.guard`` (API key,
``application/json``, a bounded body read in bounded time); parsing gives one typed
``RequestSettings``; tokenisation and chat templating run in a small thread pool, never on the
event loop, after a cheap length bound has refused prompts that cannot fit the context.
Every bad input is a 4xx in the route's error shape (OpenAI's on /v1, Triton's on /v2).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from eyas.api import Speculator
from eyas.serving.engine import Engine, GenRequest, QueueFullError, ServeLimits
from eyas.serving.guard import ApiKeyMiddleware, HttpConfig, error_response, read_json_body
from eyas.serving.metrics import Metrics
from eyas.serving.protocol import ApiError, ChatRequest, CompletionRequest, TritonRequest, parse
from eyas.serving.responses import collect, eyas_field, ids_of, openai_chunks, sse, triton_events, usage

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATIC = Path(__file__).parent / "static"  # the chat page at / (index.html, app.js, style.css)
ENCODE_THREADS = 2  # tokenisation / chat templating off the event loop (bodies are bounded)
log = logging.getLogger("eyas.serving")


def create_app(
    speculator: Speculator | Callable[[], Speculator],
    model_name: str,
    limits: ServeLimits | None = None,
    http: HttpConfig | None = None,
) -> FastAPI:
    """An app serving ``speculator`` (or the one a factory builds at startup) as ``model_name``."""
    limits, http = limits or ServeLimits(), http or HttpConfig()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        spec = speculator if isinstance(speculator, Speculator) else speculator()
        state["server"] = Server(spec, model_name, limits, http)
        yield
        state["server"].close()

    app = FastAPI(title="eyas", lifespan=lifespan)
    _add_error_handlers(app)
    if http.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=http.api_key)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: dict) -> None:
    """The endpoints; ``state["server"]`` is the ``Server`` built at startup."""

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


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the route's shape (``guard.error_response``): OpenAI's, or Triton's on /v2."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(request.url.path, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(request.url.path, ApiError(e.status_code, str(e.detail), None, code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, ApiError(400, str(e.errors()[0].get("msg"))))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # a bug: logged, still JSON
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        err = ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error", "server_error")
        return error_response(request.url.path, err)


class Server:
    """Request handling: validation, limits, submission to the engine, response shapes."""

    def __init__(self, spec: Speculator, model_name: str, limits: ServeLimits, http: HttpConfig) -> None:
        self.spec, self.model_name, self.limits, self.http = spec, model_name, limits, http
        self.metrics = Metrics()
        self.engine = Engine(spec, limits, self.metrics)
        self.context = spec.target.model.config.max_position_embeddings
        self.prompt_limit = min(limits.max_prompt_tokens or self.context, self.context - 1)
        self.token_chars = longest_token(spec.tokenizer)
        self.pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="eyas-encode")
        self.created = int(time.time())

    def close(self) -> None:
        self.engine.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def policy_view(self) -> dict:
        """The policy as the engine last published it; ``mode`` is the one the server was started with."""
        snap = self.engine.policy_snapshot()
        if snap is None:
            return {"mode": "none", "reason": "no drafter"}
        view = {**snap, "mode": self.limits.spec_policy, "effective_mode": snap["mode"]}
        choice = getattr(self.spec, "tree_choice", None)  # the tree eyas.autotree sized to this machine at load
        view["tree_choice"] = choice.to_dict() if choice is not None else None
        if snap["mode"] != self.limits.spec_policy and getattr(self.spec, "exact", False):
            view["reason"] = (
                "exact (batch-invariant) mode pads every forward to the full tree, so cutting trees "
                "would save nothing: full trees always"
            )
        return view

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
        body = await read_json_body(request, self.http)
        req = self._validated(ChatRequest if chat else CompletionRequest, body)
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
        gen = await self._submit(prompt, chat, req, req.token_limit(), default, "messages" if chat else "prompt",
                                 req.token_limit_name())
        ids = ids_of("chatcmpl" if chat else "cmpl", self.model_name, "chat.completion" if chat else "text_completion")
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return sse(openai_chunks(gen, request, ids, chat, include_usage), gen)
        final = await collect(gen, request)
        choice = {"index": 0, "logprobs": None, "finish_reason": final.finish_reason}
        choice.update({"message": {"role": "assistant", "content": final.text}} if chat else {"text": final.text})
        return {**ids, "choices": [choice], "usage": usage(final), "eyas": eyas_field(final)}

    # ---- Triton generate extension ----------------------------------------------------------
    async def triton(self, name: str, request: Request, stream: bool):
        if name != self.model_name:
            raise ApiError(404, f"Request for unknown model: '{name}' is not found (serving '{self.model_name}')")
        req = self._validated(TritonRequest, await read_json_body(request, self.http))
        try:
            p = req.merged()
        except ApiError:
            self.metrics.observe_reject("invalid")
            raise
        gen = await self._submit(req.text_input, False, p, p.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "text_input")
        head = {"model_name": self.model_name, "model_version": "1"}
        if stream:
            return sse(triton_events(gen, request, head), gen, triton=True)
        final = await collect(gen, request)
        # like Triton's vLLM backend: the prompt is echoed unless exclude_input_in_output (not when streaming)
        text = final.text if p.exclude_input_in_output else req.text_input + final.text
        return {**head, "text_output": text, "finish_reason": final.finish_reason, "usage": usage(final),
                "eyas": eyas_field(final)}

    # ---- shared ------------------------------------------------------------------------------
    def _validated(self, model, body: bytes):
        try:
            return parse(model, body)
        except ApiError:
            self.metrics.observe_reject("invalid")
            raise

    async def _submit(
        self, prompt, chat: bool, p, max_tokens: int | None, default: int | None, param: str, limit_name="max_tokens"
    ) -> GenRequest:
        """Check, encode (off the loop), check again, queue. p: a parsed request (``settings``)."""
        try:
            self._check_max_tokens(max_tokens, limit_name)
            self._check_text_length(prompt, param)
            ids = await asyncio.get_running_loop().run_in_executor(self.pool, self._encode, prompt, chat, param)
            n = int(ids.shape[0])
            if n > self.prompt_limit:
                raise self._too_long(param, str(n))
            room = self.context - n
            if max_tokens is not None and max_tokens > room:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.context} tokens; the {_noun(param)} "
                    f"{n} tokens and max_tokens asks for {max_tokens}. Lower max_tokens or shorten the {param}.",
                    "max_tokens",
                    "context_length_exceeded",
                )
        except ApiError:
            self.metrics.observe_reject("invalid")
            raise
        max_new = max_tokens or min(default or self.limits.max_tokens, self.limits.max_tokens, room)
        gen = GenRequest(ids=ids, settings=p.settings(max_new), loop=asyncio.get_running_loop())
        try:
            self.engine.submit(gen)
        except QueueFullError as e:
            raise ApiError(429, str(e), None, "queue_full", "rate_limit_error") from None
        return gen

    def _encode(self, prompt, chat: bool, param: str):
        """Thread pool: prompt text or messages -> [T] ids (a refusing template is the client's problem)."""
        try:
            return self.spec.encode(prompt, chat=chat)
        except Exception as e:
            raise ApiError(400, f"could not encode the {param}: {e}", param) from None

    def _check_max_tokens(self, max_tokens: int | None, name: str) -> None:
        if max_tokens is not None and max_tokens > self.limits.max_tokens:
            raise ApiError(
                400,
                f"{name} is {max_tokens}; this server allows at most {self.limits.max_tokens} "
                "(--max-tokens-limit).",
                name,
                "invalid_value",
            )

    def _check_text_length(self, prompt, param: str) -> None:
        """Refuse, before tokenising, a text too long for the context whatever its tokens.

        No token is longer than ``token_chars`` characters, so a text of c characters has at least
        ceil(c / token_chars) tokens (the chat template only adds some).
        """
        if self.token_chars is None:
            return
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        least = -(-chars // self.token_chars)
        if least > self.prompt_limit:
            raise self._too_long(param, f"at least {least}")

    def _too_long(self, param: str, n: str) -> ApiError:
        return ApiError(
            400,
            f"The {_noun(param)} {n} tokens long; this server accepts at most {self.prompt_limit} "
            f"(--max-prompt-tokens / the model's context of {self.context}).",
            param,
            "context_length_exceeded",
        )


def _noun(param: str) -> str:
    """Subject and verb for a length message: 'messages' -> 'messages (chat template applied) are'."""
    return "messages (chat template applied) are" if param == "messages" else f"{param} is"


def longest_token(tokenizer) -> int | None:
    """Characters in the vocabulary's longest token string (None: the tokenizer cannot tell)."""
    try:
        return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t) or None
    except (AttributeError, TypeError, ValueError):
        return None
