"""The serving engine: one worker thread runs continuous batching over a ``BatchDecoder``.

Requests wait in a bounded queue (full -> ``QueueFullError``, an HTTP 429). Between steps
the worker admits queued requests into free batch rows (prefill, first token), drops rows
whose client went away (``cancel`` set: the slot is free for the next step), and runs one
batched step: every row drafts, one target forward verifies all trees, each row accepts its
own tokens. Each row is a ``SpecDecoder`` built by ``Speculator.decoder`` from the request's
typed ``RequestSettings`` -- the call ``Speculator.generate`` makes -- so served output equals
library output (in fp32 at any concurrency; tested). Text deltas (``eyas.detok``: stop strings,
per-token pieces) reach the request's asyncio queue through ``loop.call_soon_threadsafe``. A
``SpecPolicy`` picks the tree width per step from the batch size (``eyas.policy``), seeded by a
calibration when the worker starts; the worker publishes a snapshot of it under a lock
(``policy_snapshot``), so readers never touch the policy while the worker updates it.
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
from eyas.detok import Detokenizer
from eyas.policy import PolicyConfig
from eyas.serving.metrics import Metrics
from eyas.types import RequestSettings, StepStats

log = logging.getLogger("eyas.serving")


class QueueFullError(RuntimeError):
    """The request queue holds ``max_queue`` requests already."""


@dataclass
class ServeLimits:
    max_queue: int = 64  # requests waiting (the running one not counted)
    max_tokens: int = 2048  # largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # None: the model's context
    max_batch: int = 8  # requests decoded together (continuous batching)
    # speculation by load (eyas.policy): auto (measured), always (full trees) or never
    spec_policy: str = "auto"
    calibrate: bool = True  # time the target's forwards at start to seed the policy


@dataclass(eq=False)  # hashed by identity: the request is its batch row's key
class GenRequest:
    # [T] long prompt ids
    ids: torch.Tensor
    settings: RequestSettings
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    """Text and tokens of one decoder step."""

    text: str  # new text (held back near a possible stop string or inside a character)
    token_ids: list[int]
    num_accepted: int  # leading tokens that were drafted and accepted
    pieces: list[str]  # each token's own text (eyas.detok), for the page's marks


@dataclass
class Final:
    finish_reason: str  # "stop", "length" or "abort" (cancelled)
    text: str
    token_ids: list[int]  # every generated id, the stop token included
    prompt_tokens: int
    spec: dict  # drafted, accepted, steps, mean_accepted_length, accepted_per_position
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled


@dataclass
class Failure:
    message: str


@dataclass
class _Active:
    """A request in the batch and what has been sent for it."""

    req: GenRequest
    text: Detokenizer
    ids: list[int] = field(default_factory=list)
    last: float = 0.0  # time of the previous event
    counted: tuple[int, int, int] = (0, 0, 0)  # decoder stats (steps, drafted, accepted) already observed


class Engine:
    def __init__(self, spec: Speculator, limits: ServeLimits, metrics: Metrics) -> None:
        self.spec, self.limits, self.metrics = spec, limits, metrics
        self.stop_ids = set(spec.stop_ids())
        self.batch = spec.batch_decoder(limits.max_batch, PolicyConfig(mode=limits.spec_policy))
        self.calibrate = limits.calibrate
        self.active: dict[GenRequest, _Active] = {}
        self._policy_lock = threading.Lock()
        self._policy: dict | None = None  # the last published snapshot (policy_snapshot)
        self._published = 0.0
        self._publish_policy(force=True)
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

    def policy_snapshot(self) -> dict | None:
        """The speculation policy as the worker last published it (None: no drafter); any thread."""
        with self._policy_lock:
            return None if self._policy is None else dict(self._policy)

    def _publish_policy(self, force: bool = False, every_s: float = 0.25) -> None:
        """Worker thread (or before it starts): snapshot the policy, at most every ``every_s`` seconds."""
        policy, now = self.batch.policy, time.monotonic()
        if policy is None or not force and now - self._published < every_s:
            return
        running = len(self.active)
        snap = {"running": running, **policy.snapshot(max(running, 1), self.limits.max_batch)}
        with self._policy_lock:
            self._policy, self._published = snap, now

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

    # ---- the worker loop ----------------------------------------------------------------------
    def _run(self) -> None:
        if self.calibrate:
            t0 = time.perf_counter()
            self.batch.calibrate()
            if self.batch.policy is not None:
                log.info("speculation policy calibrated in %.1f s: %s", time.perf_counter() - t0,
                         self.batch.policy.snapshot(1))
            self._publish_policy(force=True)
        while self._admit():
            self._drop_cancelled()
            if self.active:
                self._step()

    def _admit(self) -> bool:
        """Move queued requests into free rows; blocks while nothing runs. False: shut down."""
        while len(self.active) < self.limits.max_batch:
            try:
                req = self._queue.get(block=not self.active)
            except queue.Empty:
                return True
            if req is None:
                for a in list(self.active.values()):
                    self._finish(a, "abort")
                return False
            self.metrics.waiting = self._queue.qsize()
            if req.cancel.is_set():
                self.metrics.observe_finish("abort", 0, time.perf_counter() - req.arrival)
                continue
            self._guarded(req, self._start, req)
        return True

    def _start(self, req: GenRequest) -> None:
        a = _Active(req, Detokenizer(self.spec.tokenizer, req.settings.stop), last=req.arrival)
        ev = self.batch.add(req, req.ids, settings=req.settings)  # None: prefilled chunk by chunk in step()
        self.active[req] = a
        self.metrics.running = len(self.active)
        if ev is not None:
            self._deliver(a, ev)

    def _step(self) -> None:
        try:
            events = self.batch.step()
        except Exception as e:  # a failing step fails its rows, never the worker
            log.exception("batched step failed")
            for a in list(self.active.values()):
                self._fail(a.req, e)
            return
        policy = self.batch.policy
        self.metrics.width = policy.last_width if policy is not None else 1
        self._publish_policy()
        for req, ev in events:
            self._guarded(req, self._deliver, self.active[req], ev)

    def _deliver(self, a: _Active, ev) -> None:
        """Send one step's tokens; finish the request on a stop, the length limit or a cancel."""
        now, toks = time.perf_counter(), ev.tokens.tolist()
        self.metrics.observe_tokens(len(toks), now - a.last, first=not a.ids)
        s = self.batch.decoder(a.req).stats
        steps, drafted, accepted = a.counted
        if s.steps > steps:  # a verification step (prefill is not one)
            self.metrics.observe_draft(s.drafted - drafted, s.accepted - accepted)
        a.counted, a.last = (s.steps, s.drafted, s.accepted), now
        a.ids += toks
        delta = a.text.push(toks, ev.finished)
        _post(a.req, Delta(delta.text, toks, ev.num_accepted, delta.pieces))
        if toks and toks[-1] in self.stop_ids or a.text.stopped:
            self._finish(a, "stop")
        elif a.req.cancel.is_set():
            self._finish(a, "abort")
        elif ev.finished:
            self._finish(a, "length")

    def _drop_cancelled(self) -> None:
        for a in [a for a in self.active.values() if a.req.cancel.is_set()]:
            self._finish(a, "abort")

    def _finish(self, a: _Active, reason: str) -> None:
        req = a.req
        dec = self.batch.decoder(req)
        stats, cached, prompt = spec_stats(dec.stats), dec.cached_prompt_tokens, int(req.ids.shape[0])
        self._release(req)
        self.metrics.observe_finish(reason, prompt, time.perf_counter() - req.arrival, cached)
        _post(req, Final(reason, a.text.text, a.ids, prompt, stats, cached))

    def _release(self, req: GenRequest) -> None:
        if self.active.pop(req, None) is not None:
            self.batch.remove(req)
        self.metrics.running = len(self.active)

    def _guarded(self, req: GenRequest, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a failing request must not kill the worker
            log.exception("request failed")
            self._fail(req, e)

    def _fail(self, req: GenRequest, e: Exception) -> None:
        try:
            self._release(req)
        except Exception:  # the row may never have been added
            log.exception("releasing a failed row")
        _post(req, Failure(f"generation failed: {type(e).__name__}: {e}"))


def spec_stats(s: StepStats) -> dict:
    """Per-response speculative statistics from a decoder's StepStats."""
    return {
        "drafted": s.drafted,
        "accepted": s.accepted,
        "steps": s.steps,
        "mean_accepted_length": round(s.mean_accepted, 4),
        "accepted_per_position": list(s.accepted_per_pos),
    }


def _post(req: GenRequest, item: Delta | Final | Failure) -> None:
    try:
        req.loop.call_soon_threadsafe(req.out.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is listening
        pass
