"""``eyas data``: the target regenerates the assistant answers of prompt sets (self-distillation).

eyas data --out data/smollm2.jsonl                                # all four train sources, embedded model
eyas data --prompts gsm8k,mt_bench_101 --limit 500 --shuffle-seed 0 --out d.jsonl
eyas data --prompts my_sharegpt.jsonl --model ./Llama-3.1-8B-Instruct --batch-size 32 --out d.jsonl
eyas data --endpoint http://127.0.0.1:8000/v1 --concurrency 64 --out d.jsonl   # vLLM / SGLang server
eyas data --prompts magpie --limit 20000 --out magpie.jsonl       # the target writes the requests too

A killed run continues where it stopped when started again with the same --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from eyas.data.output import OutputFile, Sink
from eyas.data.sources import TRAIN_SOURCES, read_sources

DEFAULT_DATA_DIR = "../shared/data/train"  # relative to the working directory; EYAS_DATA_DIR overrides


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``data`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "data", help="self-distillation data: the target regenerates the answers of prompt sets",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts", action="append", default=None,
                   help="'all' (default: " + ", ".join(TRAIN_SOURCES) + "), one of those names, 'magpie' "
                        "(the target writes the user requests itself; --limit N of them), or a "
                        ".jsonl/.json file of ShareGPT / OpenAI-messages conversations; comma-separated "
                        "or repeated")
    p.add_argument("--data-dir", default=None,
                   help=f"folder of the named train sources (default: $EYAS_DATA_DIR or {DEFAULT_DATA_DIR})")
    p.add_argument("--out", required=True, help="output .jsonl (OpenAI chat format); appended to and resumed")
    p.add_argument("--limit", type=int, default=None, help="at most N conversations per source")
    p.add_argument("--shuffle-seed", type=int, default=None,
                   help="shuffle each source with this seed before --limit (default: file order)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="native: rows decoded together; finished rows are refilled with new prompts at once")
    p.add_argument("--prefill-rows", type=int, default=16, help="native: prompts prefilled in one forward")
    p.add_argument("--max-slots", type=int, default=2048,
                   help="native: KV-cache slots per row, prompt + answer (memory: batch x slots x ~46 KB for "
                        "SmolLM2); longer turns get a shorter answer budget")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--magpie-temperature", type=float, default=1.0,
                   help="magpie: sampling temperature of the user requests (> 0)")
    p.add_argument("--magpie-top-p", type=float, default=1.0, help="magpie: top-p of the user requests")
    p.add_argument("--magpie-max-tokens", type=int, default=256, help="magpie: longest user request")
    p.add_argument("--model", default=None,
                   help="HF model dir, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="native: weights dtype (auto: bfloat16 where bf16 matmuls are native, a GPU or a CPU "
                        "with AVX512-BF16/AMX, else float32: bf16 GEMM cost there grows with the batch rows)")
    p.add_argument("--device", default="auto",
                   help="native: torch device of the target (auto: cuda where one is visible, else cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="native: torch CPU threads (default: torch's choice, one per core). On a CPU shared with "
                        "other jobs, 1 avoids OpenMP threads spinning while their peers wait for a core")
    p.add_argument("--endpoint", default=None,
                   help="generate through an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", default=None, help="--endpoint: model name (default: first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=8, help="--endpoint: requests in flight")
    p.set_defaults(func=cmd_data)
    return p


def cmd_data(a: argparse.Namespace) -> int:
    """Run ``eyas data``; returns the exit code."""
    if a.endpoint is None and a.api_model is not None:
        raise ValueError("--api-model names a model on a server; pass --endpoint URL too (or use --model)")
    specs, magpie = _split_magpie(a.prompts or ["all"], a)
    data_dir = a.data_dir or os.environ.get("EYAS_DATA_DIR") or DEFAULT_DATA_DIR
    convs = read_sources(specs, data_dir, a.limit, a.shuffle_seed) if specs else []
    out = OutputFile(a.out)
    done = out.resume()
    try:
        todo = [c for c in convs if c.id not in done]
        if len(todo) < len(convs):
            print(f"data: resuming, {len(convs) - len(todo)} of {len(convs)} conversations already in "
                  f"{out.path}", file=sys.stderr)
        wanted = len(todo) + (max(0, magpie.count - sum(i.startswith("magpie:") for i in done)) if magpie else 0)
        if not wanted:
            print(f"data: nothing to do, all {len(convs) + (magpie.count if magpie else 0)} conversations are in "
                  f"{out.path}")
            return 0
        gen = _generator(a, magpie)
        progress = _Progress(wanted)
        sink = Sink(out, gen.describe(), progress)
        extra = None
        if magpie is not None:
            from eyas.data.magpie import MagpieJobs

            extra = MagpieJobs(gen, magpie, done, sink)
        try:
            gen.run(todo, sink, extra) if extra is not None else gen.run(todo, sink)
        finally:
            progress.close()
        if extra is not None:
            print(extra.summary(), file=sys.stderr)
        _summary(sink, time.perf_counter() - progress.t0, out)
    finally:
        out.close()
    return 0


def _split_magpie(prompts: list[str], a: argparse.Namespace):
    """--prompts specs without 'magpie', and the MagpieConfig when 'magpie' was named (else None)."""
    items = [s.strip() for spec in prompts for s in spec.split(",") if s.strip()]
    if "magpie" not in items:
        return prompts, None
    if a.endpoint is not None:
        raise ValueError("--prompts magpie runs on the native target (it continues the chat template's user "
                         "prefix); drop --endpoint")
    if a.limit is None:
        raise ValueError("--prompts magpie has no natural size: pass --limit N (Magpie conversations wanted)")
    from eyas.data.magpie import MagpieConfig

    cfg = MagpieConfig(count=a.limit, temperature=a.magpie_temperature, top_p=a.magpie_top_p,
                       max_user_tokens=a.magpie_max_tokens)
    return [i for i in items if i != "magpie"], cfg


def _generator(a: argparse.Namespace, magpie=None):
    if a.endpoint is not None:
        from eyas.data.remote import RemoteConfig, RemoteGenerator

        cfg = RemoteConfig(endpoint=a.endpoint, api_model=a.api_model, concurrency=a.concurrency,
                           max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                           seed=a.seed)
        return RemoteGenerator(cfg)
    import torch

    import eyas
    from eyas.data.generate import GenConfig, NativeGenerator

    if a.threads is not None:
        if a.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)

    cfg = GenConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                    seed=a.seed, batch_size=a.batch_size, prefill_rows=a.prefill_rows,
                    max_slots=a.max_slots)  # validate before loading
    user = magpie.sampling if magpie is not None else None
    spec = eyas.load(model=a.model, drafter="none", dtype=a.dtype, device=_device(a.device))
    return NativeGenerator(spec, cfg, user_sampling=user)


def _device(name: str):
    """--device: 'auto' -> cuda where visible, else cpu; anything else must name a usable torch device."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e}); use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch build or machine has no CUDA device; use --device cpu")
    return dev


def _summary(sink: Sink, seconds: float, out: OutputFile) -> None:
    for conv_id, why in sink.skipped[:5]:
        print(f"data: skipped {conv_id}: {why}", file=sys.stderr)
    if len(sink.skipped) > 5:
        print(f"data: ... and {len(sink.skipped) - 5} more skipped", file=sys.stderr)
    rate = sink.generated_tokens / seconds if seconds > 0 else 0.0
    skipped = f" ({len(sink.skipped)} skipped)" if sink.skipped else ""
    print(f"data: {sink.conversations} conversations{skipped}, {sink.generated_tokens} generated tokens "
          f"in {seconds:.1f} s: {rate:.1f} tok/s -> {out.path}")


class _Progress:
    """A tqdm bar over conversations with the generated tokens/s as its postfix."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="conv", desc="eyas data", dynamic_ncols=True, file=sys.stderr)
        self.t0 = time.perf_counter()

    def tokens(self, total_tokens: int) -> None:
        dt = time.perf_counter() - self.t0
        rate = total_tokens / dt if dt > 0 else 0.0
        self.bar.set_postfix_str(f"{total_tokens} tok, {rate:.1f} tok/s", refresh=False)

    def advance(self, skipped: bool = False) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
