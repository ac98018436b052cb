"""The same regeneration through any OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI ...).

Conversations run on ``concurrency`` threads, one conversation per thread at a time,
its turns in order (turn k's request carries the server's own earlier answers);
the server batches the concurrent requests itself. Temperature 0 (greedy) unless
asked otherwise. The model name defaults to the first id of ``GET /v1/models``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urlsplit

from eyas.data.output import Sink, TurnAnswer, history_messages
from eyas.data.sources import Conversation
from eyas.types import SamplingParams


@dataclass
class RemoteConfig:
    endpoint: str  # server root (http://host:8000) or its /v1 base URL
    api_model: str | None = None  # None: the first id of GET /v1/models
    concurrency: int = 8
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    timeout: float = 600.0  # seconds per request
    max_retries: int = 2  # the client retries connection errors, 429 and 5xx with backoff
    # the key servers that check one expect; most local servers accept anything
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingParams(self.temperature, 0, self.top_p)  # the same range checks as native decoding
        self.endpoint = base_url(self.endpoint)


def base_url(endpoint: str) -> str:
    """The client's base URL: ``http://h:8000`` -> ``http://h:8000/v1``; a path given is kept.

    Example: ``http://h:8000/v1/chat/completions`` -> ``http://h:8000/v1``.
    """
    url = endpoint.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--endpoint {endpoint!r} is not an http(s) URL; e.g. --endpoint http://127.0.0.1:8000/v1")
    url = url.removesuffix("/chat/completions")
    return url if urlsplit(url).path else url + "/v1"


class RemoteGenerator:
    """Regenerates conversations through ``/v1/chat/completions``."""

    def __init__(self, cfg: RemoteConfig, client=None) -> None:
        self.cfg = cfg
        self.client = client if client is not None else _client(cfg)
        self.model = cfg.api_model or self._first_model()

    def describe(self) -> dict:
        """Provenance stored with every output line."""
        c = self.cfg
        return {
            "backend": "openai-api", "endpoint": c.endpoint, "model": self.model,
            "max_new_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p,
            "seed": c.seed,
        }

    def run(self, convs: Sequence[Conversation], sink: Sink) -> None:
        """Regenerate every conversation; ``sink`` is only called from this (the calling) thread."""
        todo = iter(convs)
        with ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="eyas-data") as pool:
            running: dict[Future, Conversation] = {}
            try:
                while True:
                    while len(running) < 2 * self.cfg.concurrency:  # a bounded queue, not 60k futures
                        conv = next(todo, None)
                        if conv is None:
                            break
                        running[pool.submit(self.conversation, conv)] = conv
                    if not running:
                        return
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        self._report(running.pop(fut), fut.result(), sink)
            except BaseException:
                for fut in running:
                    fut.cancel()
                raise

    @staticmethod
    def _report(conv: Conversation, result: list[TurnAnswer] | str, sink: Sink) -> None:
        if isinstance(result, str):
            sink.skip(conv, result)
        else:
            sink.tokens(sum(a.completion_tokens for a in result))
            sink.done(conv, result)

    def conversation(self, conv: Conversation) -> list[TurnAnswer] | str:
        """All turns of one conversation in order; a string says why the server refused it."""
        import openai

        answers: list[TurnAnswer] = []
        for _ in conv.turns:
            try:
                answers.append(self.complete(history_messages(conv, answers)))
            except openai.BadRequestError as e:  # e.g. the prompt exceeds the server's context
                return f"server refused turn {len(answers) + 1}: {_short(e)}"
        return answers

    def complete(self, messages: list[dict]) -> TurnAnswer:
        """One chat completion."""
        import openai

        c = self.cfg
        extra = {} if c.seed is None else {"seed": c.seed}
        try:
            resp = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=c.max_new_tokens,
                temperature=c.temperature, top_p=c.top_p, **extra,
            )
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise ValueError(f"cannot reach {c.endpoint} ({_short(e)}); is the server running? "
                             f"check --endpoint") from None
        except openai.BadRequestError:
            raise  # this conversation only; conversation() skips it
        except openai.APIStatusError as e:  # 401, 404 (unknown model), 5xx after retries: stop the run
            raise ValueError(f"{c.endpoint} answered HTTP {e.status_code} ({_short(e)}); check --endpoint, "
                             f"--api-model {self.model!r} and OPENAI_API_KEY") from None
        choice = resp.choices[0]
        usage = resp.usage
        text = choice.message.content or ""
        return TurnAnswer(
            text=text,
            prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
            completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
            finish_reason=choice.finish_reason or "stop",
        )

    def _first_model(self) -> str:
        import openai

        try:
            models = [m.id for m in self.client.models.list()]
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise ValueError(f"cannot reach {self.cfg.endpoint} ({_short(e)}); is the server running? "
                             f"check --endpoint") from None
        except openai.APIError as e:
            raise ValueError(f"{self.cfg.endpoint}/models failed ({_short(e)}); "
                             f"pass --api-model NAME") from None
        if not models:
            raise ValueError(f"{self.cfg.endpoint}/models lists no model; pass --api-model NAME")
        return models[0]


def _client(cfg: RemoteConfig):
    try:
        import openai
    except ImportError:
        raise ValueError("--endpoint needs the openai client: pip install openai") from None
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return openai.OpenAI(base_url=cfg.endpoint, api_key=key, timeout=cfg.timeout, max_retries=cfg.max_retries)


def _short(e: Exception) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= 200 else msg[:197] + "..."
