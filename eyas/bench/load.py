r"""`eyas bench load`: a GenAI-Perf-style load client for any OpenAI-compatible server.

    eyas serve --drafter ngram &                      # or vLLM / SGLang / any OpenAI server
    eyas bench load --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 64 \
        --compare-speculation --json load.json --plot load.png

For each concurrency level C it keeps exactly C streaming chat completions in flight
(closed loop, as GenAI-Perf's concurrency mode: a worker sends its next request when its
previous one ends) until N requests are done, then reports time to first token, inter-token
latency, request latency, sequence lengths and throughputs (definitions in
``eyas.bench.load_stats``). Output tokens are counted with the served model's tokenizer.

``--compare-speculation`` measures each level twice, with and without the drafter, back to
back so machine noise hits both alike: against one eyas server through the request field
``speculate: false``, or against a second server (``--baseline-url``, e.g. one started
with ``--drafter none``, or any non-eyas server; ``--no-eyas-fields`` never sends the field).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from eyas.bench.load_stats import (
    RequestRecord,
    compare_levels,
    format_comparison,
    format_level,
    level_metrics,
)

if TYPE_CHECKING:  # the HTTP client (httpx) is imported when a load run starts, not by `eyas --help`
    from eyas.bench.load_client import Side

# Used when no --questions file is given: short, varied first turns.
DEFAULT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List five fruits and one fact about each.",
    "What is 17 times 23? Show your steps.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Write a Python function that reverses a string.",
    "Give three tips for writing clear emails.",
    "Describe the water cycle to a ten-year-old.",
)
EMBEDDED_NAMES = ("smollm2-135m-instruct", "embedded:smollm2-135m-instruct", "embedded", "default")


@dataclass
class LoadConfig:
    url: str
    concurrency: list[int] = field(default_factory=lambda: [1])
    requests: int | None = None  # per level; None: max(8, 4 * concurrency)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    warmup: int = 1  # untimed requests per side before its first level
    endpoint: str = "chat"  # chat (/v1/chat/completions) or completions (/v1/completions)
    model: str | None = None  # None: the first id of GET /v1/models
    tokenizer: str | None = None  # None: the served model's id
    compare_speculation: bool = False
    baseline_url: str | None = None  # the plain side of the comparison on another server
    eyas_fields: bool = True  # send the eyas request field `speculate` (never for non-eyas servers)
    timeout: float = 600.0  # seconds per request

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency needs positive integers, got {self.concurrency}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be positive, got {self.requests}")
        if self.max_tokens < 1 or self.warmup < 0:
            raise ValueError("--max-tokens must be positive and --warmup not negative")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"--endpoint must be chat or completions, got {self.endpoint!r}")
        self.url = base_url(self.url)
        if self.baseline_url is not None:
            self.baseline_url = base_url(self.baseline_url)
            self.compare_speculation = True
        if self.compare_speculation and not self.eyas_fields and self.baseline_url is None:
            raise ValueError(
                "--compare-speculation with --no-eyas-fields needs --baseline-url: a second "
                "server decoding without a drafter"
            )

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(8, 4 * concurrency)


def base_url(url: str) -> str:
    """http://host:port, whether given with a trailing /v1 or slash or not."""
    url = url.rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    return url


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model id of GET URL/v1/models."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", timeout=timeout)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(
            f"could not read the served model from {url}/v1/models ({type(e).__name__}: {e}); "
            f"is the server up? (or pass --model NAME)"
        ) from None


def load_tokenizer(name: str):
    """The served model's tokenizer: the embedded SmolLM2's, a local dir or .gguf, or a hub id."""
    from transformers import AutoTokenizer

    try:
        if name.lower() in EMBEDDED_NAMES:
            from eyas.models.loading import resolve_model_dir

            return AutoTokenizer.from_pretrained(resolve_model_dir(None))
        p = Path(name).expanduser()
        if p.suffix == ".gguf" and p.is_file():
            return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load the tokenizer {name!r} ({type(e).__name__}); output tokens are "
            f"counted with the served model's tokenizer: pass --tokenizer DIR_OR_HUB_ID"
        ) from None


def load_prompts(path: str | None) -> list[str]:
    """First turns of an EAGLE/Spec-Bench question.jsonl, or the built-in prompts."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    from eyas.bench.speed import read_questions

    return [q["turns"][0] for q in read_questions(path, None)]


def make_sides(cfg: LoadConfig) -> list[Side]:
    """The runs to measure: one, or speculative and plain for a comparison."""
    from eyas.bench.load_client import Side

    model = cfg.model or served_model(cfg.url)
    if not cfg.compare_speculation:
        return [Side("default", cfg.url, model, None)]
    spec = Side("speculative", cfg.url, model, True if cfg.eyas_fields else None)
    if cfg.baseline_url is None:
        return [spec, Side("plain", cfg.url, model, False)]
    return [spec, Side("plain", cfg.baseline_url, cfg.model or served_model(cfg.baseline_url), None)]


def _prompt_tokens(tok, prompt: str, chat: bool) -> int:
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return len(
            ids["input_ids"] if hasattr(ids, "keys") else ids
        )  # transformers 5 returns a BatchEncoding
    return len(tok.encode(prompt, add_special_tokens=False))


def count_tokens(records: list[RequestRecord], tok, prompts: list[str], chat: bool) -> None:
    """Fill OSL (tokenizer count of the whole text), per-chunk counts, and ISL (usage, else the tokenizer)."""
    for r in records:
        for c in r.chunks:
            c.tokens = len(tok.encode(c.text, add_special_tokens=False))
        if r.ok:
            r.osl = len(tok.encode(r.text, add_special_tokens=False))
            r.isl = (
                r.prompt_tokens
                if r.prompt_tokens is not None
                else _prompt_tokens(tok, prompts[r.prompt_index], chat)
            )


def run_sweep(cfg: LoadConfig, sides: list[Side], prompts: list[str], tok, keep_records: bool) -> dict:
    """Every level for every side, the sides back to back per level; prints each level's table."""
    from eyas.bench.load_client import measure_level

    levels: dict[str, list[dict]] = {s.label: [] for s in sides}
    for side in sides:
        if cfg.warmup:
            warm = asyncio.run(measure_level(cfg, side, 1, prompts, cfg.warmup, None))
            failed = [r.error for r in warm if not r.ok]
            if failed:
                print(f"warning: {side.label} warm-up failed: {failed[0]}", file=sys.stderr)
    for c in cfg.concurrency:
        n = cfg.requests_at(c)
        for side in sides:
            with tqdm(total=n, desc=f"{side.label} c={c}", unit="req", file=sys.stderr) as bar:
                records = asyncio.run(measure_level(cfg, side, c, prompts, n, bar))
            count_tokens(records, tok, prompts, cfg.endpoint == "chat")
            level = {"concurrency": c, "metrics": level_metrics(records)}
            if keep_records:
                level["records"] = [r.to_dict() for r in records]
            levels[side.label].append(level)
            print(
                format_level(f"\n== {side.label}: concurrency {c}, {n} requests ==", level["metrics"]),
                flush=True,
            )
    return levels


def run_load(cfg: LoadConfig, prompts: list[str], keep_records: bool = False) -> dict:
    """Resolve the model(s) and tokenizer, run the sweep, return the whole report."""
    sides = make_sides(cfg)
    tok_name = cfg.tokenizer or sides[0].model
    tok = load_tokenizer(tok_name)
    levels = run_sweep(cfg, sides, prompts, tok, keep_records)
    report = {
        "config": asdict(cfg),
        "sides": [asdict(s) for s in sides],
        "tokenizer": tok_name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "levels": levels,
    }
    if cfg.compare_speculation:
        report["comparison"] = compare_levels(levels["speculative"], levels["plain"])
        print("\n" + format_comparison(levels, report["comparison"]))
    return report


def cmd_load(a) -> int:
    cfg = LoadConfig(
        url=a.url,
        concurrency=a.concurrency,
        requests=a.requests,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        seed=a.seed,
        warmup=a.warmup,
        endpoint=a.endpoint,
        model=a.model,
        tokenizer=a.tokenizer,
        compare_speculation=a.compare_speculation,
        baseline_url=a.baseline_url,
        eyas_fields=a.eyas_fields,
        timeout=a.timeout,
    )
    report = run_load(cfg, load_prompts(a.questions), keep_records=a.records)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=2))
    if a.plot:
        from eyas.bench.plot import plot_load

        plot_load(report, a.plot)
    errors = sum(lv["metrics"]["errors"] for side in report["levels"].values() for lv in side)
    if errors:
        print(f"eyas bench load: {errors} request(s) failed (see the tables / JSON)", file=sys.stderr)
    return 1 if errors else 0


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,4,16, got {s!r}"
        ) from None


def add_load_parser(subparsers) -> None:
    """Add ``load`` to the ``eyas bench`` subparsers."""
    p = subparsers.add_parser(
        "load",
        help="GenAI-Perf style load test of an OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=_int_list, default=[1], help="levels, e.g. 1,4,16 (default 1)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(8, 4 x C))")
    p.add_argument(
        "--questions", default=None, help="question.jsonl (first turns, cycled; default: built-in)"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per side before measuring")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--model", default=None, help="model name to send (default: GET /v1/models)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer that counts tokens: dir, .gguf, hub id or 'embedded' (default: the served model)",
    )
    p.add_argument(
        "--compare-speculation",
        action="store_true",
        help="measure every level with and without the drafter (eyas `speculate` request field)",
    )
    p.add_argument(
        "--baseline-url",
        default=None,
        help="compare against this server instead (plain decoding there); implies --compare-speculation",
    )
    p.add_argument(
        "--no-eyas-fields",
        dest="eyas_fields",
        action="store_false",
        help="never send eyas request fields (a non-eyas server)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", dest="json_out", default=None, help="write config and per-level metrics here")
    p.add_argument("--records", action="store_true", help="also write every request's raw record to --json")
    p.add_argument("--plot", default=None, help="PNG: throughput, ITL and TTFT against concurrency")
    p.set_defaults(func=cmd_load)
