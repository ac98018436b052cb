"""Records and statistics of `eyas bench load` (pure: no HTTP, no tokenizer).

Definitions follow NVIDIA GenAI-Perf (its LLM metrics, concurrency mode):

- time to first token (TTFT): from sending the request to the first chunk with content.
- request latency: from sending the request to the end of its stream (``[DONE]``).
- inter-token latency (ITL), per request: ``(request latency - TTFT) / (OSL - 1)``; requests
  with fewer than two output tokens have none.
- output sequence length (OSL): output tokens, counted with the served model's tokenizer on
  the streamed text (so any OpenAI server is measured alike); input sequence length (ISL):
  ``usage.prompt_tokens`` (chat template included) when the server reports it.
- output token throughput: the level's output tokens over its wall time (first send to last
  end); request throughput: successful requests over the same wall time.

Worked example (one request): sent at 0 s, content chunks at 0.10, 0.15 and 0.30 s, stream
over at 0.31 s, 5 output tokens: TTFT = 100 ms, latency = 310 ms, ITL = (310 - 100) / 4 = 52.5 ms.

Every statistic is avg/min/max/p50/p75/p90/p99 over the successful requests of one level
(percentiles interpolate linearly, numpy's default, as GenAI-Perf does). A failed request
(HTTP error, error event, stream without ``[DONE]`` or finish_reason) is counted in
``errors`` and kept out of the statistics, never dropped silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

STATS = ("avg", "min", "max", "p50", "p75", "p90", "p99")


@dataclass
class Chunk:
    t: float  # seconds after the request was sent
    text: str
    server_tokens: int | None = None  # len(eyas.token_ids) when the server reports them
    tokens: int | None = None  # tokenizer count of ``text`` (filled after the level)


@dataclass
class RequestRecord:
    index: int  # request number within the level
    prompt_index: int
    start: float = 0.0  # time.perf_counter() at send
    latency: float | None = None  # seconds from send to the end of the stream (or the failure)
    chunks: list[Chunk] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    spec: dict | None = None  # the final chunk's eyas stats (drafted, accepted, steps, ...)
    error: str | None = None
    isl: int | None = None  # input tokens (usage, else the tokenizer)
    osl: int | None = None  # output tokens, tokenizer count of the whole text

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0].t if self.chunks else None

    @property
    def itl(self) -> float | None:
        """GenAI-Perf's per-request inter-token latency in seconds (None below two tokens)."""
        if self.osl is None or self.osl < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.osl - 1)

    @property
    def server_osl(self) -> int | None:
        """Output tokens as the server counts them: usage, else the chunks' token_ids."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        counts = [c.server_tokens for c in self.chunks if c.server_tokens is not None]
        return sum(counts) if counts else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("start")
        d.update(ok=self.ok, ttft=self.ttft, itl=self.itl, server_osl=self.server_osl)
        return d


def summarize(values: list[float | None], scale: float = 1.0) -> dict | None:
    """avg/min/max/p50/p75/p90/p99 of the non-None values times ``scale``; None when empty."""
    xs = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if xs.size == 0:
        return None
    pct = np.percentile(xs, [50, 75, 90, 99])
    out = {"avg": xs.mean(), "min": xs.min(), "max": xs.max()}
    out.update({f"p{p}": v for p, v in zip((50, 75, 90, 99), pct, strict=True)})
    return {k: float(out[k]) for k in STATS}


def wall_seconds(records: list[RequestRecord]) -> float:
    """First send to last end over every request of a level, failed ones included."""
    ends = [r.start + r.latency for r in records if r.latency is not None]
    return max(ends) - min(r.start for r in records) if ends else 0.0


def mean_accepted_length(records: list[RequestRecord]) -> float | None:
    """tau = 1 + accepted / steps over the level's requests (vLLM's definition); None without stats."""
    stats = [r.spec for r in records if r.ok and r.spec and "steps" in r.spec and "accepted" in r.spec]
    steps = sum(s["steps"] for s in stats)
    return 1.0 + sum(s["accepted"] for s in stats) / steps if steps else None


def level_metrics(records: list[RequestRecord]) -> dict:
    """GenAI-Perf metrics of one concurrency level (latencies in ms, throughputs per second)."""
    ok = [r for r in records if r.ok]
    wall = wall_seconds(records)
    out_tokens = sum(r.osl or 0 for r in ok)
    server = [r.server_osl for r in ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "wall_seconds": wall,
        "time_to_first_token_ms": summarize([r.ttft for r in ok], 1e3),
        "inter_token_latency_ms": summarize([r.itl for r in ok], 1e3),
        "request_latency_ms": summarize([r.latency for r in ok], 1e3),
        "output_sequence_length": summarize([r.osl for r in ok]),
        "input_sequence_length": summarize([r.isl for r in ok]),
        "output_token_throughput": out_tokens / wall if wall else None,
        "request_throughput": len(ok) / wall if wall else None,
        "output_token_throughput_per_request": summarize(
            [r.osl / r.latency for r in ok if r.osl is not None and r.latency]
        ),
        # the server's own counts (usage / token_ids; the stop token included) next to the tokenizer's
        "server_output_sequence_length": summarize(server),
        "server_output_token_throughput": (
            sum(server) / wall if wall and server and None not in server else None
        ),
        "mean_accepted_length": mean_accepted_length(records),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _avg(m: dict, key: str) -> float | None:
    return m[key]["avg"] if m.get(key) else None


def compare_levels(spec: list[dict], plain: list[dict]) -> dict:
    """Per-level speculative/plain ratios, each > 1 where speculation wins.

    spec, plain: level dicts (``{"concurrency": C, "metrics": {...}}``) in the same order.
    ``break_even_concurrency``: where speculation stops paying (see ``break_even``), None if
    it still pays at the highest level.
    """
    rows = []
    for s, p in zip(spec, plain, strict=True):
        a, b = s["metrics"], p["metrics"]
        rows.append(
            {
                "concurrency": s["concurrency"],
                "output_throughput_ratio": _ratio(a["output_token_throughput"], b["output_token_throughput"]),
                "itl_speedup": _ratio(_avg(b, "inter_token_latency_ms"), _avg(a, "inter_token_latency_ms")),
                "ttft_speedup": _ratio(_avg(b, "time_to_first_token_ms"), _avg(a, "time_to_first_token_ms")),
                "latency_speedup": _ratio(_avg(b, "request_latency_ms"), _avg(a, "request_latency_ms")),
            }
        )
    return {"levels": rows, "break_even_concurrency": break_even(rows)}


def break_even(rows: list[dict]) -> int | None:
    """The lowest concurrency from which speculation loses (throughput ratio < 1) at every level.

    rows: ``compare_levels`` rows in concurrency order. Scanning down from the highest level,
    so one noisy losing level below winning ones is not called the turning point: ratios
    0.95, 1.12, 0.9, 0.8 at C = 1, 2, 4, 8 -> 4.
    """
    found = None
    for row in reversed(rows):
        ratio = row["output_throughput_ratio"]
        if ratio is None or ratio >= 1.0:
            break
        found = row["concurrency"]
    return found


# ---- text tables (GenAI-Perf's layout, plain ASCII) ------------------------------------------
_ROWS = (
    ("Time to first token (ms)", "time_to_first_token_ms"),
    ("Inter token latency (ms)", "inter_token_latency_ms"),
    ("Request latency (ms)", "request_latency_ms"),
    ("Output sequence length", "output_sequence_length"),
    ("Input sequence length", "input_sequence_length"),
)
_COLUMNS = ("avg", "min", "max", "p99", "p90", "p75", "p50")


def _cell(v: float | None) -> str:
    return "N/A" if v is None else f"{v:.2f}"


def format_level(title: str, m: dict) -> str:
    """One level's metrics as GenAI-Perf prints them: a row per statistic, then the totals."""
    w = 34
    head = f"{'Statistic':>{w}} | " + " | ".join(f"{c:>9}" for c in _COLUMNS)
    lines = [title, head, "-" * len(head)]
    for label, key in _ROWS:
        s = m.get(key) or {}
        lines.append(f"{label:>{w}} | " + " | ".join(f"{_cell(s.get(c)):>9}" for c in _COLUMNS))
    for label, key in (
        ("Output token throughput (per sec)", "output_token_throughput"),
        ("Request throughput (per sec)", "request_throughput"),
    ):
        lines.append(f"{label:>{w}} | {_cell(m.get(key)):>9}")
    tau = m.get("mean_accepted_length")
    extra = f", mean accepted length {tau:.2f}" if tau is not None else ""
    lines.append(f"errors {m['errors']}/{m['requests']}, wall {m['wall_seconds']:.2f} s{extra}")
    lines += [f"  error: {e}" for e in m.get("error_messages", [])]
    return "\n".join(lines)


def format_comparison(levels: dict[str, list[dict]], cmp: dict) -> str:
    """Speculative vs plain per level: throughput, ITL and TTFT side by side with their ratios."""
    spec, plain = levels["speculative"], levels["plain"]
    head = (
        f"{'concurrency':>11} | {'tok/s spec':>10} {'plain':>8} {'ratio':>6} | "
        f"{'ITL ms spec':>11} {'plain':>8} {'speedup':>7} | {'TTFT ms spec':>12} {'plain':>8} {'speedup':>7}"
    )
    lines = ["Speculative vs plain decoding (ratios > 1: speculation wins)", head, "-" * len(head)]
    for s, p, r in zip(spec, plain, cmp["levels"], strict=True):
        a, b = s["metrics"], p["metrics"]
        ratio = r["output_throughput_ratio"]
        mark = "  (slower)" if ratio is not None and ratio < 1.0 else ""
        mark = "  <- speculation stops paying" if r["concurrency"] == cmp["break_even_concurrency"] else mark
        lines.append(
            f"{r['concurrency']:>11} | {_cell(a['output_token_throughput']):>10} "
            f"{_cell(b['output_token_throughput']):>8} {_cell(r['output_throughput_ratio']):>6} | "
            f"{_cell(_avg(a, 'inter_token_latency_ms')):>11} {_cell(_avg(b, 'inter_token_latency_ms')):>8} "
            f"{_cell(r['itl_speedup']):>7} | {_cell(_avg(a, 'time_to_first_token_ms')):>12} "
            f"{_cell(_avg(b, 'time_to_first_token_ms')):>8} {_cell(r['ttft_speedup']):>7}{mark}"
        )
    return "\n".join(lines)
