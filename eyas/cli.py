"""eyas command line: generate, bench, data (self-distillation), train, serve.

eyas generate "PROMPT" [--model M] [--drafter none|ngram|PATH] [--tree ...] [--json]
eyas bench speed --questions FILE [--limit K] [--drafter ...] [--json OUT]
eyas bench load --url URL [--concurrency 1,4,16] [--compare-speculation] [--json OUT] [--plot PNG]
eyas convert SRC OUT --to eagle3|speculators|gguf|eagle1|eagle1-vllm|medusa|medusa-vllm [--verifier NAME_OR_DIR]
eyas cache [info | purge [--stale] [--only conversions|kernels|timings]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from eyas.verify import LOSSY_NOTE

TREE_HELP = (
    "draft tree: 'dynamic[:TOP_K,DEPTH,TOTAL]' (EAGLE-2; or sizes via --top-k/--depth/--total-tokens), "
    "'adaptive:TOP_K,DEPTH,FEED,PRICES' (sized each step from the head's confidence; without --tree a "
    "head with a profile gets one priced for this machine, shown by --json), "
    "'static[:PRESET|CHOICES]' (EAGLE-1/Medusa choices list, e.g. static:mc_sim_7b_63 or "
    "'static:[[0],[1],[0,0]]'), or 'chain[:K]'"
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--drafter", default="default",
                   help="default, none (plain decoding), ngram, hybrid, eagle3, eagle, medusa, draft, or a path to "
                        "an EAGLE / Medusa head or draft LM dir (a head kind by name alone: the target's shipped head)")
    p.add_argument("--tree", default=None, help=TREE_HELP)
    p.add_argument("--top-k", type=int, default=None, help="dynamic tree: children per expanded node")
    p.add_argument("--depth", type=int, default=None, help="dynamic tree: deepest draft level")
    p.add_argument("--total-tokens", type=int, default=None, help="dynamic tree: draft tokens kept")
    p.add_argument("--num-draft", type=int, default=None, help="ngram / draft LM: tokens drafted per step")
    p.add_argument("--max-ngram", type=int, default=None, help="ngram: longest suffix looked up")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="top-k filter of the sampling distribution")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto (default): bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32 "
                        "(bf16 tree verification is slow without them)")
    p.add_argument("--backend", default="native", choices=["native", "hf"],
                   help="native (fast Llama-family) or hf (any transformers causal LM, slower)")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: weight-only int8 target projections (faster single-token steps on CPU). This "
                        "CHANGES THE MODEL'S OUTPUTS relative to bf16/fp32; speculation stays lossless with "
                        "respect to the int8 model")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant verification: every target forward gets one width and key length, "
                        "so bf16 output equals plain decoding token for token (default: on for bfloat16, and for "
                        "float32 where it is the faster mode (a GGUF target on a CPU); off otherwise; with "
                        "--no-exact bf16 output may drift; see docs)")
    p.add_argument("--typical", action="store_true",
                   help="Medusa typical acceptance (posterior_threshold/alpha). " + LOSSY_NOTE)
    p.add_argument("--posterior-threshold", type=float, default=0.09)
    p.add_argument("--posterior-alpha", type=float, default=0.3)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _non_negative_int(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _tree_spec(a: argparse.Namespace) -> str | None:
    if a.tree in (None, "dynamic") and any(v is not None for v in (a.top_k, a.depth, a.total_tokens)):
        return "dynamic:" + ",".join(str(v) for v in (a.top_k or 8, a.depth or 6, a.total_tokens or 48))
    return a.tree


def _drafter_options(a: argparse.Namespace) -> dict:
    opts = {}
    if a.num_draft is not None:
        opts["num_draft"] = a.num_draft
    if a.max_ngram is not None:
        opts["max_ngram"] = a.max_ngram
    return opts


def _load(a: argparse.Namespace):
    import eyas

    return eyas.load(model=a.model, drafter=a.drafter, dtype=a.dtype, backend=a.backend,
                     tree=_tree_spec(a), exact=a.exact, quantize=a.quantize, **_drafter_options(a))


def gen_params(a: argparse.Namespace) -> dict:
    from eyas.verify import TypicalConfig

    params = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p,
              "top_k": a.sample_top_k, "seed": a.seed}
    if a.typical:
        params["typical"] = TypicalConfig(a.posterior_threshold, a.posterior_alpha)
    return params


def cmd_generate(a: argparse.Namespace) -> int:
    spec = _load(a)
    params = gen_params(a)
    if a.compare_plain:  # untimed warm-up, so first-call kernel setup does not count against either side
        spec.generate(a.prompt, chat=not a.raw, **{**params, "max_new_tokens": 8})
    if a.json:
        out = spec.generate(a.prompt, chat=not a.raw, **params)
        d = out.to_dict()
        if spec.tree_choice is not None:  # the tree eyas.autotree sized to this machine, and its prediction
            d["tree_choice"] = spec.tree_choice.to_dict()
        from eyas.bench.speed import kernel_tuning

        if (tuning := kernel_tuning(spec.target.model)) is not None:  # the block kernel's options for this machine
            d["kernel_tuning"] = tuning
        if a.compare_plain:
            d["plain"] = _compare(spec, a, params, out.tokens_per_second, out.token_ids).to_dict()
        print(json.dumps(d))
        return 0
    import time

    t0, ids, acc = time.perf_counter(), [], 0
    for piece, ev in spec.stream_events(a.prompt, chat=not a.raw, **params):
        ids += ev.tokens.tolist()
        acc += ev.num_accepted
        sys.stdout.write(piece)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n\n[{len(ids)} tokens in {dt:.2f}s: {len(ids) / dt:.1f} tok/s, drafter={_drafter_label(spec, a)}, "
          f"{acc} drafted tokens accepted]", file=sys.stderr)
    if a.compare_plain:
        print(_compare(spec, a, params, len(ids) / dt, ids).summary(), file=sys.stderr)
    return 0


def _drafter_label(spec, a: argparse.Namespace) -> str:
    """The drafter as given, with what ``default`` resolved to (the shipped head or ngram)."""
    if a.drafter != "default":
        return a.drafter
    from pathlib import Path

    from eyas.drafters.loading import default_drafter_name

    dtype = str(spec.target.model.dtype).removeprefix("torch.")
    name = default_drafter_name(spec.target)
    head = getattr(getattr(spec.drafter, "head", None), "path", None)
    what = "hybrid: shipped head + prompt lookup" if name == "hybrid" else Path(name).name
    return f"default ({what}, dtype {dtype})" if head is None else f"default ({what}, {Path(head).name}, dtype {dtype})"


def _compare(spec, a: argparse.Namespace, params: dict, spec_tps: float, ids: list[int]):
    """Plain decoding of the same prompt against the speculative run just made (eyas.bench.plain_compare)."""
    from eyas.bench.plain_compare import compare_plain

    return compare_plain(spec, a.prompt, not a.raw, params, (spec_tps, ids), a.repeats)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eyas", description="Lossless speculative decoding.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, ids and statistics")
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding and print the measured speedup and whether outputs match")
    g.add_argument("--repeats", type=_positive_int, default=3,
                   help="--compare-plain: timed runs of each side, interleaved; medians are reported (default 3)")
    _common(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    s = bsub.add_parser("speed", help="Spec-Bench style: plain vs speculative decoding in one process")
    s.add_argument("--questions", required=True, help="question.jsonl (EAGLE/Spec-Bench format)")
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--json", dest="json_out", default=None, help="write results to this JSON file")
    s.add_argument("--plot", default=None, help="write a PNG bar chart of per-question speedup")
    s.add_argument("--compare-hf", action="store_true", help="also time HF generate (plain) in the same run")
    s.add_argument("--compare-llamacpp", action="store_true",
                   help="also run llama.cpp plain decoding of the same GGUF (needs llama-cpp-python: pip install "
                        "'eyas[llamacpp]', a ~8 minute source build); reports its prompt and decode tok/s apart")
    s.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations")
    s.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first: each question's first turn; all: every turn in the conversation so far, earlier "
                        "turns answered by plain decoding's output (Spec-Bench's MT-bench)")
    s.add_argument("--prefix-cache-mb", type=_non_negative_int, default=0,
                   help="give plain and speculative decoding each its own prefix cache of this size, kept across "
                        "questions as eyas serve keeps one (exact mode; a later turn reuses the earlier ones' "
                        "prefill; default 0: off)")
    _common(s)
    from eyas.bench.speed import cmd_speed

    s.set_defaults(func=cmd_speed)
    from eyas.bench.load import add_load_parser

    add_load_parser(bsub)
    from eyas.bench.forward import add_forward_parser

    add_forward_parser(bsub)
    from eyas.data.command import add_data_parser
    from eyas.serving.command import add_serve_parser
    from eyas.train.command import add_train_parser

    add_data_parser(sub)
    add_train_parser(sub)
    add_serve_parser(sub)
    from eyas.formats.convert import add_convert_parser

    add_convert_parser(sub)
    from eyas.cache import add_cache_parser

    add_cache_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head and the like
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the interpreter's final flush does not fail too
        return 0
    except (ValueError, FileNotFoundError, KeyError) as e:  # user errors: one clear line, no traceback
        if os.environ.get("EYAS_DEBUG"):
            raise
        msg = e.args[0] if e.args else str(e)
        print(f"eyas: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
