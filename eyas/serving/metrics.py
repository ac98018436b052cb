"""Prometheus metrics in text format, named after vLLM's (``vllm:`` -> ``eyas:``).

Speculative counters follow vLLM's v1 ``SpecDecodingStats``: drafts, draft tokens, accepted
tokens and accepted tokens per draft position, so tau = 1 + accepted / drafts. One
difference, on purpose: every verification step counts as a draft, including steps where
the drafter proposed nothing (an n-gram miss), so tau here equals the per-response
``mean_accepted_length`` and ``GenerationResult.mean_accepted`` (1 + accepted / steps).
Inter-token latency is observed once per step per request, as vLLM v1 does, so a step
that emits several tokens is one observation.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cum += c
            out.append(f'{name}_bucket{{le="{"+Inf" if le == float("inf") else le}"}} {cum}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    """Thread-safe counters and histograms; the engine thread writes, /metrics reads."""

    def __init__(self, prefix: str = "eyas") -> None:
        self.prefix = prefix
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}  # finished_reason -> requests
        self.rejected: dict[str, int] = {}  # reason (queue_full, invalid) -> requests
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0  # of prompt_tokens, taken from the prefix cache
        self.generation_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.running = 0
        self.waiting = 0
        self.width = 0  # tree nodes per row verified in the last step (1 = plain, policy's choice)

    def observe_draft(self, num_drafted: int, num_accepted: int) -> None:
        with self.lock:
            self.drafts += 1
            self.draft_tokens += num_drafted
            self.accepted_tokens += num_accepted
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
            for i in range(num_accepted):
                self.accepted_per_pos[i] += 1

    def observe_tokens(self, n: int, latency: float, first: bool) -> None:
        with self.lock:
            self.generation_tokens += n
            (self.ttft if first else self.itl).observe(latency)

    def observe_finish(self, reason: str, prompt_tokens: int, e2e: float, cached_tokens: int = 0) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.prefix_hit_tokens += cached_tokens
            self.e2e.observe(e2e)

    def observe_reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def render(self) -> str:
        p = self.prefix
        with self.lock:
            out: list[str] = []
            for name, kind, help_, samples in self._families(p):
                out.extend([f"# HELP {p}:{name} {help_}", f"# TYPE {p}:{name} {kind}", *samples])
        return "\n".join(out) + "\n"

    def _families(self, p: str) -> list[tuple[str, str, str, list[str]]]:
        """(name, type, help, sample lines) of every metric family, in exposition order; called under the lock."""
        def one(name: str, value) -> list[str]:
            return [f"{p}:{name} {value}"]

        def labelled(name: str, label: str, items) -> list[str]:
            return [f'{p}:{name}{{{label}="{k}"}} {v}' for k, v in items]

        return [
            ("num_requests_running", "gauge", "Requests being decoded.", one("num_requests_running", self.running)),
            ("num_requests_waiting", "gauge", "Requests in the queue.", one("num_requests_waiting", self.waiting)),
            ("spec_decode_verify_width", "gauge",
             "Tree nodes per request verified in the last step (the speculation policy's choice; 1 = plain).",
             one("spec_decode_verify_width", self.width)),
            ("request_success", "counter", "Finished requests by finish reason.",
             labelled("request_success_total", "finished_reason", sorted(self.finished.items()))),
            ("request_rejected", "counter", "Requests refused before decoding, by reason.",
             labelled("request_rejected_total", "reason", sorted(self.rejected.items()))),
            ("prompt_tokens", "counter", "Prompt tokens of finished requests (prefilled or from the prefix cache).",
             one("prompt_tokens_total", self.prompt_tokens)),
            ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
             one("prefix_cache_queries_total", self.prompt_tokens)),
            ("prefix_cache_hits", "counter", "Prompt tokens taken from the prefix cache instead of prefilled.",
             one("prefix_cache_hits_total", self.prefix_hit_tokens)),
            ("generation_tokens", "counter", "Generated tokens.",
             one("generation_tokens_total", self.generation_tokens)),
            ("time_to_first_token_seconds", "histogram", "Arrival to first token.",
             self.ttft.lines(f"{p}:time_to_first_token_seconds")),
            ("inter_token_latency_seconds", "histogram", "Time between a request's consecutive steps.",
             self.itl.lines(f"{p}:inter_token_latency_seconds")),
            ("e2e_request_latency_seconds", "histogram", "Arrival to finish.",
             self.e2e.lines(f"{p}:e2e_request_latency_seconds")),
            ("spec_decode_num_drafts", "counter", "Verification steps (tau = 1 + accepted / drafts).",
             one("spec_decode_num_drafts_total", self.drafts)),
            ("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.",
             one("spec_decode_num_draft_tokens_total", self.draft_tokens)),
            ("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
             one("spec_decode_num_accepted_tokens_total", self.accepted_tokens)),
            ("spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens by position (0 = first).",
             labelled("spec_decode_num_accepted_tokens_per_pos_total", "position", enumerate(self.accepted_per_pos))),
        ]
