"""``eyas serve``: an OpenAI- and Triton-compatible HTTP server around one Speculator.

eyas serve                                         # embedded SmolLM2 + its default drafter, 127.0.0.1:8000
eyas serve --model ./Llama-3.1-8B-Instruct --drafter ./EAGLE3-head --port 9000 --max-queue 128

eyas serve --api-key "$(openssl rand -hex 16)"        # or EYAS_API_KEY=...: /v1 and /v2 need the bearer key

Endpoints: GET / (a chat page), /health, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions,
/v2/models/NAME/generate and /v2/models/NAME/generate_stream. With a key, /v1 and /v2 answer 401 without
`Authorization: Bearer KEY`; /health, /metrics and the page stay open (as in vLLM).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI and Triton generate APIs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="HF model dir, .gguf file or hub id (default: embedded SmolLM2)"
    )
    p.add_argument("--drafter", default="default",
                   help="default, none, ngram, hybrid, eagle3, eagle, medusa, draft, or a path to a head (a head "
                        "kind by name alone: the target's shipped head)")
    p.add_argument("--tree", default=None, help="draft tree spec, as for `eyas generate --tree`")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32",
    )
    p.add_argument("--backend", default="native", choices=["native", "hf"])
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: weight-only int8 target (CHANGES the model's outputs; lossless w.r.t. the int8 model)")
    p.add_argument(
        "--served-model-name", default=None, help="name clients send as `model` (default: from --model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before new ones get HTTP 429")
    p.add_argument(
        "--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask for"
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context)"
    )
    _add_batching_args(p)
    p.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 and /v2 (default: $EYAS_API_KEY)"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=2 << 20, help="largest request body; larger ones get HTTP 413"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a request body to arrive (else HTTP 408)"
    )
    p.set_defaults(func=cmd_serve)
    return p


def _add_batching_args(p: argparse.ArgumentParser) -> None:
    """Continuous batching, speculation by load and the prefix cache."""
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (continuous batching)")
    p.add_argument(
        "--spec-policy",
        default="auto",
        choices=["auto", "always", "never"],
        help="speculation by load: auto picks the tree width per batch size from measured forward "
        "costs and acceptance (eyas.policy); always: full trees; never: plain decoding",
    )
    p.add_argument(
        "--prefix-cache-mb", type=int, default=256,
        help="keep prefilled prompts up to this many MiB; a prompt that starts with one (a system prompt, a chat's "
        "earlier turns) prefills only the rest, with the same tokens (exact mode); 0: off",
    )
    p.add_argument(
        "--no-calibrate", action="store_true", help="skip timing the target's forwards at start (auto policy)"
    )


def served_name(model: str | None) -> str:
    """Default public model name: a local dir's or .gguf file's name, else --model as given (a hub id)."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    if not path.exists():
        return model
    name = path.resolve().name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def http_config(a: argparse.Namespace):
    """The HTTP guards from the flags; the key from --api-key, else $EYAS_API_KEY (an empty one: no key)."""
    from eyas.serving.guard import API_KEY_ENV, HttpConfig

    return HttpConfig(a.max_body_bytes, a.body_timeout, a.api_key or os.environ.get(API_KEY_ENV) or None)


def cmd_serve(a: argparse.Namespace) -> int:
    for flag, v in (
        ("--max-queue", a.max_queue),
        ("--max-batch", a.max_batch),
        ("--max-tokens-limit", a.max_tokens_limit),
        ("--max-prompt-tokens", 1 if a.max_prompt_tokens is None else a.max_prompt_tokens),
        ("--port", a.port + 1),
    ):
        if v < 1:
            raise ValueError(f"{flag} must be positive, got {v}")
    if a.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0 (0 turns the prefix cache off), got {a.prefix_cache_mb}")
    try:
        import uvicorn
    except ImportError:
        raise ValueError("eyas serve needs fastapi and uvicorn: pip install fastapi uvicorn") from None
    import eyas
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    http = http_config(a)
    limits = ServeLimits(
        max_queue=a.max_queue, max_tokens=a.max_tokens_limit, max_prompt_tokens=a.max_prompt_tokens,
        max_batch=a.max_batch, spec_policy=a.spec_policy, calibrate=not a.no_calibrate,
    )

    def build():
        spec = eyas.load(model=a.model, drafter=a.drafter, dtype=a.dtype, backend=a.backend, tree=a.tree,
                         quantize=a.quantize, prefix_cache_mb=a.prefix_cache_mb)
        return create_app(spec, a.served_model_name or served_name(a.model), limits, http)

    app = off_main_thread(build)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    return 0


def off_main_thread(fn):
    """``fn()`` run in a thread that ends with it; its result returned, its exception raised here.

    The model runs in the engine's worker thread. Loading it in the main thread would leave the main thread
    an OpenMP thread pool of its own (torch's libgomp keeps one per thread that opened a parallel region, until
    that thread exits); with two pools on a 2-core machine libgomp counts more threads than cores and stops
    spinning between parallel regions, so every one of a decode step's ~200 small regions waits on a futex.
    Measured on the Zen 5 VM, bf16: the 121 projections of a 1-token forward 4.5 ms in one pool against 8.8 ms
    with a second; `eyas serve` at one client decoded 61.7 tok/s plainly (`--spec-policy never`) where
    `eyas generate` makes ~150 (docs/benchmarks.md).
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-load") as pool:  # leaving joins the thread
        future = pool.submit(fn)
    return future.result()  # fn's exception, re-raised in the caller's thread: the CLI prints it as before
