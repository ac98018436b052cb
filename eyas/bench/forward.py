"""`eyas bench forward`: what one target forward costs by the number of new tokens.

The verify-cost curve every speculation decision rests on: a forward over N new tokens (a chain
of N nodes after a ``--prefix``-token context), in the fast mode and in exact mode (path attention,
row-invariant GEMMs), median of ``--repeats`` after a warm-up. Prints a table, and writes JSON
and a PNG when asked.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from eyas.models.attention import round_up
from eyas.models.base import PathAttention, causal_mask


def time_forward(model, n: int, prefix: int, exact: bool, repeats: int) -> float:
    """Median ms of one forward over n new tokens after ``prefix`` cached ones (batch 1)."""
    dev = model.device
    cache = model.new_cache(1, prefix + n + 1)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (1, prefix), generator=g).to(dev)
    model.forward(ctx, torch.arange(prefix, device=dev)[None], cache, 0)
    tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(dev)
    positions = torch.arange(prefix, prefix + n, device=dev)[None]
    chain = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    kwargs = {"mask": causal_mask(n, prefix, device=dev)[None]}
    if exact:  # as SpecDecoder does: the compiled kernel where the target has one, else a mirror per node
        kernel = model.path_kernel()
        mirror = None if n == 1 or kernel is not None else model.new_cache(n, prefix + n + 1)
        if mirror is not None:
            mirror.broadcast_from(cache, 0, prefix)
        kwargs = {"paths": PathAttention.from_tree_mask(chain, prefix, round_up(prefix + n), mirror, kernel)}
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        model.forward(tokens, positions, cache, prefix, **kwargs)
        if i >= 2:  # two warm-ups: kernel selection, exact mode's row-floor probe
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def run_forward(model, widths: list[int], prefix: int, repeats: int, exact_too: bool) -> dict:
    rows = []
    for n in widths:
        row = {"tokens": n, "ms": time_forward(model, n, prefix, False, repeats)}
        if exact_too:
            row["exact_ms"] = time_forward(model, n, prefix, True, repeats)
        rows.append(row)
    base = rows[0]["ms"]
    for r in rows:
        r["relative"] = r["ms"] / base
    return {"prefix": prefix, "repeats": repeats, "rows": rows}


def plot_forward(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in rows], [r["ms"] for r in rows], "o-", label="fast mode")
    if "exact_ms" in rows[0]:
        ax.plot([r["tokens"] for r in rows], [r["exact_ms"] for r in rows], "s--", label="exact mode")
    ax.set_xlabel("new tokens in the forward (tree nodes)")
    ax.set_ylabel("ms per forward")
    s = result.get("settings", {})
    ax.set_title(f"target forward cost, {s.get('dtype_used', '')}, prefix {result['prefix']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_forward(a) -> int:
    from eyas.bench.speed import cpu_model
    from eyas.models.loading import load_target

    widths = sorted({int(x) for x in a.widths.split(",")})
    if not widths or widths[0] < 1:
        raise ValueError(f"--widths must be positive integers, got {a.widths!r}")
    model = load_target(a.model, a.dtype, quantize=a.quantize).model
    result = run_forward(model, widths, a.prefix, a.repeats, exact_too=not a.no_exact)
    result["settings"] = {"model": a.model or "embedded", "dtype_used": str(model.dtype).removeprefix("torch."),
                          "quantize": a.quantize, "cpu": cpu_model(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"{'tokens':>6} {'ms':>8} {'x1':>6} {'exact ms':>9}")
    for r in result["rows"]:
        ex = f"{r['exact_ms']:9.2f}" if "exact_ms" in r else ""
        print(f"{r['tokens']:>6} {r['ms']:8.2f} {r['relative']:6.2f} {ex}")
    print(json.dumps(result["settings"]))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=2))
    if a.plot:
        plot_forward(result, a.plot)
    return 0


def add_forward_parser(bsub) -> None:
    f = bsub.add_parser("forward", help="target forward cost by number of new tokens (fast and exact mode)")
    f.add_argument("--model", default=None, help="HF model dir, .gguf file or hub id (default: embedded SmolLM2)")
    f.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    f.add_argument("--quantize", default="none", choices=["none", "int8"])
    f.add_argument("--widths", default="1,2,3,4,6,8,12,16,24,32")
    f.add_argument("--prefix", type=int, default=256, help="cached context tokens before the new ones")
    f.add_argument("--repeats", type=int, default=10)
    f.add_argument("--no-exact", action="store_true", help="skip the exact-mode column")
    f.add_argument("--json", dest="json_out", default=None)
    f.add_argument("--plot", default=None, help="PNG of the cost curve")
    f.set_defaults(func=cmd_forward)
