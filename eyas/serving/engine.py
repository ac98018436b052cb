"""The serving engine for now: one worker thread decodes requests one at a time.

Requests wait in a bounded queue (full -> ``QueueFullError``, an HTTP 429). The worker
runs ``Speculator.decoder(...).generate(ids)`` -- the same call ``Speculator.generate``
makes, so served output equals library output -- and hands every step's text delta to the
request's asyncio queue with ``loop.call_soon_threadsafe``. A request whose ``cancel`` flag
is set (the client went away) stops between decoder steps, or is skipped if still queued.
Batching across requests comes later; this class is the seam it will replace.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from eyas.api import Speculator
from eyas.serving.metrics import Metrics

log = logging.getLogger("eyas.serving")


class QueueFullError(RuntimeError):
    """The request queue holds ``max_queue`` requests already."""


@dataclass
class ServeLimits:
    max_queue: int = 64  # requests waiting (the running one not counted)
    max_tokens: int = 2048  # largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # None: the model's context


@dataclass
class GenRequest:
    # [T] long prompt ids
    ids: torch.Tensor
    params: dict  # Speculator.decoder kwargs: max_new_tokens, temperature, top_p, top_k, seed
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    """Text and tokens of one decoder step."""

    text: str
    token_ids: list[int]
    num_accepted: int  # leading tokens that were drafted and accepted


@dataclass
class Final:
    finish_reason: str  # "stop", "length" or "abort" (cancelled)
    text: str
    token_ids: list[int]  # every generated id, the stop token included
    prompt_tokens: int
    spec: dict  # drafted, accepted, steps, mean_accepted_length, accepted_per_position


@dataclass
class Failure:
    message: str


class TextStream:
    """Incremental detokenisation with stop strings.

    Text that could still grow into a stop string (its last ``max(len(stop)) - 1`` chars)
    is held back until it cannot, so a stop string never reaches the client.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # text sent so far
        self.stopped = False

    def push(self, ids: list[int], finished: bool) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not finished:  # wait for the rest of a UTF-8 sequence
            return ""
        hits = [i for i in (text.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0]
        if hits:
            text, finished, self.stopped = text[: min(hits)], True, True
        end = len(text) if finished else max(len(self.text), len(text) - self.hold)
        delta = text[len(self.text) : end]
        self.text += delta
        return delta


class Engine:
    def __init__(self, spec: Speculator, limits: ServeLimits, metrics: Metrics) -> None:
        self.spec, self.limits, self.metrics = spec, limits, metrics
        self.stop_ids = set(spec.stop_ids())
        self._queue: queue.Queue[GenRequest | None] = queue.Queue(maxsize=limits.max_queue)
        self._thread = threading.Thread(target=self._run, name="eyas-engine", daemon=True)
        self._thread.start()

    def submit(self, req: GenRequest) -> None:
        try:
            self._queue.put_nowait(req)
        except queue.Full:
            self.metrics.observe_reject("queue_full")
            raise QueueFullError(
                f"the server's request queue is full ({self.limits.max_queue} waiting, the --max-queue "
                "limit); retry later"
            ) from None
        self.metrics.waiting = self._queue.qsize()

    def close(self, timeout: float = 5.0) -> None:
        while True:  # make room for the sentinel: drop queued requests
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                req = self._queue.get_nowait()
                if req is not None:
                    _post(req, Failure("the server is shutting down"))
        self._thread.join(timeout)

    def _run(self) -> None:
        while (req := self._queue.get()) is not None:
            self.metrics.waiting = self._queue.qsize()
            if req.cancel.is_set():
                self.metrics.observe_finish("abort", 0, time.perf_counter() - req.arrival)
                continue
            self.metrics.running = 1
            try:
                self._serve(req)
            except Exception as e:  # a failing request must not kill the worker
                log.exception("request failed")
                _post(req, Failure(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self.metrics.running = 0

    def _serve(self, req: GenRequest) -> None:
        dec = self.spec.decoder(**req.params)
        text = TextStream(self.spec.tokenizer, req.stop)
        ids: list[int] = []
        last, reason = req.arrival, "length"
        steps = drafted = accepted = 0  # dec.stats totals at the previous event
        for ev in dec.generate(req.ids):
            now, toks = time.perf_counter(), ev.tokens.tolist()
            self.metrics.observe_tokens(len(toks), now - last, first=not ids)
            s = dec.stats
            if s.steps > steps:  # a verification step (prefill is not one)
                self.metrics.observe_draft(s.drafted - drafted, s.accepted - accepted)
            steps, drafted, accepted, last = s.steps, s.drafted, s.accepted, now
            ids += toks
            delta = text.push(toks, ev.finished)
            _post(req, Delta(delta, toks, ev.num_accepted))
            if toks and toks[-1] in self.stop_ids or text.stopped:
                reason = "stop"
            if req.cancel.is_set():
                reason = "abort"
            if text.stopped or reason == "abort":
                break
        self.metrics.observe_finish(reason, int(req.ids.shape[0]), time.perf_counter() - req.arrival)
        _post(req, Final(reason, text.text, ids, int(req.ids.shape[0]), spec_stats(dec.stats)))


def spec_stats(s) -> dict:
    """Per-response speculative statistics from a decoder's StepStats."""
    return {
        "drafted": s.drafted,
        "accepted": s.accepted,
        "steps": s.steps,
        "mean_accepted_length": round(1.0 + s.accepted / s.steps, 4) if s.steps else 1.0,
        "accepted_per_position": list(s.accepted_per_pos),
    }


def _post(req: GenRequest, item: Delta | Final | Failure) -> None:
    try:
        req.loop.call_soon_threadsafe(req.out.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is listening
        pass
