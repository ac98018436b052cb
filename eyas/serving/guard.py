"""What a request passes before any work: an API key, a JSON content type, a bounded body read in bounded time.

* **API key** (``--api-key KEY`` or ``EYAS_API_KEY``), as vLLM does it: every route under
  ``/v1`` -- and ``/v2``, which generates too -- needs ``Authorization: Bearer KEY``, or gets
  401 in the route's error shape with ``WWW-Authenticate: Bearer``. ``/health``, ``/metrics``
  and the chat page's files stay open, as in vLLM (liveness probes and Prometheus scrapers
  carry no key; the page asks for the key when a request is refused). CORS preflights
  (``OPTIONS``) are not checked, as in vLLM; the server sends no CORS headers anyway.
* **Content type**: POST bodies must be ``application/json`` (else 415). A web page on another
  site may POST ``text/plain`` without a CORS preflight (a "simple request"), never
  ``application/json``, so no page the user opens can start generations on a local server.
* **Body size and time**: a ``Content-Length`` over ``max_body_bytes`` is refused before a byte
  is read, a chunked body as soon as it passes the limit (413, naming it); a body that has not
  fully arrived after ``body_timeout_s`` (shorter than its Content-Length, or a slow client)
  gets 408 and the connection is closed.

Errors are rendered by ``error_response``: OpenAI's shape everywhere but ``/v2``, Triton's there.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from eyas.serving.protocol import ApiError

API_KEY_ENV = "EYAS_API_KEY"
PROTECTED = ("/v1/", "/v2/")  # route prefixes that need the key


@dataclass
class HttpConfig:
    max_body_bytes: int = 2 << 20  # 2 MiB: far above any prompt that fits a 128k-token context
    body_timeout_s: float = 30.0  # seconds for a request body to arrive completely
    api_key: str | None = None  # None: no authentication

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"--body-timeout must be positive, got {self.body_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")


def error_response(path: str, e: ApiError) -> JSONResponse:
    """``e`` in the error shape of the route at ``path``: Triton's on /v2, OpenAI's elsewhere."""
    body = e.triton_body() if path.startswith("/v2/") else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for a protected route without ``Authorization: Bearer KEY``."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith(PROTECTED):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        err = ApiError(
            401,
            "Incorrect or missing API key: send the header `Authorization: Bearer <key>` with the key the "
            f"server was started with (--api-key or {API_KEY_ENV}).",
            None,
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(scope["path"], err)(scope, receive, send)


async def read_json_body(request: Request, cfg: HttpConfig) -> bytes:
    """The request's body, after the content-type, size and time checks of the module docstring."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {ctype or 'none'!r}.",
            None,
            "unsupported_media_type",
        )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cfg.max_body_bytes:
        raise _too_large(cfg)
    try:
        return await asyncio.wait_for(_read(request, cfg), cfg.body_timeout_s)
    except TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {cfg.body_timeout_s:g} s (--body-timeout); "
            "check that Content-Length matches the body.",
            None,
            "body_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read(request: Request, cfg: HttpConfig) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cfg.max_body_bytes:
            raise _too_large(cfg)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(cfg: HttpConfig) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than this server's limit of {cfg.max_body_bytes} bytes (--max-body-bytes).",
        None,
        "body_too_large",
        headers={"Connection": "close"},
    )
