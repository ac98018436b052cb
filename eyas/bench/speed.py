"""`eyas bench speed`: Spec-Bench-style speed benchmark.

For each question (its first turn, chat template applied; with ``--turns all`` every turn, each in the
conversation so far, the earlier turns answered by the plain reference's output, as Spec-Bench runs MT-bench)
it runs plain decoding and the drafter in the same process with the same settings, alternating so
machine noise hits both alike, and reports tokens/s, speedup, mean accepted
length (tau: averaged over every speculative step, as Spec-Bench computes it; the mean of the questions' own
tau beside it) and whether the outputs are identical token for token. With
``--compare-hf`` it also times Hugging Face ``generate`` (plain greedy) and HF
prompt lookup on the same weights and dtype in the same run.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.bench.plain_compare import plain_runs
from eyas.kv.prefix import PrefixStore


@dataclass
class QuestionResult:
    question_id: object
    new_tokens: int
    turn: int = field(default=1, kw_only=True)  # 1-based, within the question's conversation
    plain_tps: float  # plain decoding in its faster mode (fast or exact, the faster run): the speedup baseline
    spec_tps: float
    mean_accepted: float
    identical: bool
    agreement: float  # common prefix length / output length (1.0 when identical)
    exact_plain_tps: float | None = None  # plain decoding in exact mode (the identity reference)
    fast_plain_tps: float | None = None  # plain decoding in fast mode (no exact rules)
    hf_tps: float | None = None
    hf_lookup_tps: float | None = None
    hf_lookup_identical: bool | None = None
    # eyas plain decoding split into prompt processing and decoding (tokens after the first)
    plain_prompt_tps: float = 0.0
    plain_decode_tps: float = 0.0
    spec_decode_tps: float = 0.0  # the speculative run's tokens after the first / its time after prefill
    plain_ttft_s: float = 0.0  # time to the first token (prefill and that token), the baseline plain run
    spec_ttft_s: float = 0.0  # the same, speculative (the draft head's pass over the prompt included)
    llamacpp_prompt_tps: float | None = None
    llamacpp_decode_tps: float | None = None
    llamacpp_agreement: float | None = None  # common prefix with eyas's plain output / length (Q4_1 vs bf16 maths)
    steps: int = 0  # target forwards after prefill (speculative run)
    draft_seconds: float = 0.0  # time inside the drafter (propose + extend) in the speculative run
    spec_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens the speculative run took from its prefix cache (--prefix-cache-mb)

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0


@dataclass
class SpeedReport:
    settings: dict
    questions: list[QuestionResult] = field(default_factory=list)

    def summary(self) -> dict:
        q = self.questions
        per_question_tau = sum(r.mean_accepted for r in q) / len(q)
        tokens = sum(r.new_tokens for r in q)
        plain_s = sum(r.new_tokens / r.plain_tps for r in q)
        spec_s = sum(r.new_tokens / r.spec_tps for r in q)
        out = {
            "questions": len(q), "new_tokens": tokens,
            "plain_tokens_per_second": tokens / plain_s, "spec_tokens_per_second": tokens / spec_s,
            "speedup": plain_s / spec_s,  # total plain time / total speculative time (conservative)
            # Spec-Bench's speedup: the questions' mean speculative tok/s over their mean plain tok/s
            "speedup_mean_tps": sum(r.spec_tps for r in q) / sum(r.plain_tps for r in q),
            # tau as Spec-Bench (evaluation/speed.py) and EAGLE report it: accepted length averaged over every step of
            # every question (pooled, below, when step counts are known); the mean of the questions' own tau weighs
            # a short easy answer like a long hard one, and reads higher (MT-bench, 2026-11-27: 2.64 against 2.37)
            "mean_accepted": per_question_tau,
            "mean_accepted_per_question": per_question_tau,
            "identical": f"{sum(r.identical for r in q)}/{len(q)}",
            "token_agreement": sum(r.agreement for r in q) / len(q),
        }
        if all(r.plain_decode_tps and r.spec_decode_tps for r in q):  # prompt processing left out of both
            dec = [max(r.new_tokens - 1, 0) for r in q]
            plain_d = sum(n / r.plain_decode_tps for n, r in zip(dec, q, strict=True))
            spec_d = sum(n / r.spec_decode_tps for n, r in zip(dec, q, strict=True))
            out.update({"decode_speedup": plain_d / spec_d if spec_d else 0.0})
        if all(r.plain_ttft_s and r.spec_ttft_s for r in q):  # what prompt processing costs each side
            out.update({"plain_ttft_ms": 1000 * sum(r.plain_ttft_s for r in q) / len(q),
                        "spec_ttft_ms": 1000 * sum(r.spec_ttft_s for r in q) / len(q),
                        "prompt_share_of_plain_time": sum(r.plain_ttft_s for r in q) / plain_s})
        steps = sum(r.steps for r in q)
        if steps:  # where a speculative step's time goes: drafting vs the rest (verify forward, commit)
            draft_s = sum(r.draft_seconds for r in q)
            out["mean_accepted"] = 1 + sum((r.mean_accepted - 1) * r.steps for r in q) / steps
            out["mean_accepted_pooled"] = out["mean_accepted"]  # the key older readers look for
            out.update({"draft_ms_per_step": 1000 * draft_s / steps,
                        "verify_commit_ms_per_step": 1000 * (sum(r.spec_seconds for r in q) - draft_s) / steps,
                        "plain_ms_per_token": 1000 * plain_s / tokens})
        if q[0].exact_plain_tps is not None:
            ex_s = sum(r.new_tokens / r.exact_plain_tps for r in q)
            fast_s = sum(r.new_tokens / (r.fast_plain_tps or r.plain_tps) for r in q)
            out.update({"exact_plain_tokens_per_second": tokens / ex_s, "fast_plain_tokens_per_second": tokens / fast_s,
                        "exact_mode_cost": ex_s / fast_s})
        if q[0].llamacpp_decode_tps is not None:
            out.update(_split_rates(q, bool((self.settings.get("target_projections") or {}).get("gguf_blocks"))))
        if q[0].hf_tps is not None:
            hf_s = sum(r.new_tokens / r.hf_tps for r in q)
            lk_s = sum(r.new_tokens / r.hf_lookup_tps for r in q)
            out.update({"hf_generate_tokens_per_second": tokens / hf_s,
                        "native_plain_vs_hf_generate": hf_s / plain_s,
                        "hf_prompt_lookup_tokens_per_second": tokens / lk_s,
                        "hf_prompt_lookup_identical": f"{sum(bool(r.hf_lookup_identical) for r in q)}/{len(q)}"})
        return out

    def to_dict(self) -> dict:
        qs = [{**asdict(r), "speedup": r.speedup} for r in self.questions]
        return {"settings": self.settings, "summary": self.summary(), "questions": qs}


def _split_rates(q: list[QuestionResult], reads_blocks: bool) -> dict:
    """Prompt and decode tok/s of eyas plain decoding and llama.cpp (harmonic: total tokens / total time);
    reads_blocks: eyas's target projections read the GGUF's blocks (the weights caveat says which).
    """
    def rate(attr: str) -> float:
        return len(q) / sum(1 / getattr(r, attr) for r in q)

    from eyas.bench.llamacpp import weights_caveat

    eyas_dec, ll_dec = rate("plain_decode_tps"), rate("llamacpp_decode_tps")
    return {"eyas_plain_decode_tokens_per_second": eyas_dec,
            "eyas_plain_prompt_tokens_per_second": rate("plain_prompt_tps"),
            "llamacpp_decode_tokens_per_second": ll_dec,
            "llamacpp_prompt_tokens_per_second": rate("llamacpp_prompt_tps"),
            "eyas_plain_decode_vs_llamacpp": eyas_dec / ll_dec, "llamacpp_weights_caveat": weights_caveat(reads_blocks),
            "llamacpp_token_agreement": sum(r.llamacpp_agreement or 0.0 for r in q) / len(q)}


def read_questions(path: str, limit: int | None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"questions file {path} does not exist")
    rows = [json.loads(line) for line in p.read_text(encoding="utf-8").split("\n") if line.strip()]
    if not rows or "turns" not in rows[0]:
        raise ValueError(f"{path}: expected EAGLE/Spec-Bench jsonl with a 'turns' list per line")
    return rows[:limit] if limit else rows


def head_projections(drafter) -> dict[str, int] | None:
    """How the drafter's head runs its projections, counted by kind ({"int8": 6, "q8_0": 1, "dense": 0}): a
    machine-dependent choice (eyas.models.int8_rows) a benchmark records beside the CPU. None without a head.
    """
    head = drafter
    while head is not None and not isinstance(head, torch.nn.Module):
        head = getattr(head, "head", None)  # the hybrid drafter's head drafter, then its module
    if head is None:
        return None
    from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks
    from eyas.models.int8_rows import Int8Rows

    counts = dict.fromkeys(("int8", "q8_0", "dense"), 0)
    for mod in head.modules():
        if isinstance(mod, torch.nn.Linear):
            blocks = attached_blocks(mod)
            kind = "int8" if isinstance(blocks, Int8Rows) else "q8_0" if isinstance(blocks, GGUFBlocks) else "dense"
            counts[kind] += 1
    return counts


def target_projections(model) -> dict[str, int]:
    """The target's projections by what they read: the GGUF file's blocks or a dense weight."""
    from eyas.models.gguf_blocks import attached_blocks

    counts = {"gguf_blocks": 0, "dense": 0}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            counts["gguf_blocks" if attached_blocks(mod) is not None else "dense"] += 1
    return counts


def cpu_model() -> str:
    """'AMD EPYC (avx512_bf16)' or the like: the CPU model and whether bf16 matmuls are native."""
    from eyas.models.cpu import cpu_flags, cpu_name

    name, flags = cpu_name(), cpu_flags()
    isa = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else (
        "avx2" if "avx2" in flags else "no avx2")
    return f"{name} ({isa})"


def _agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


class HFPeer:
    """HF generate and prompt lookup on the same weights and dtype."""

    def __init__(self, spec) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(spec.target.path, dtype=spec.target.model.dtype).eval()
        self.eos = list(spec.stop_ids())

    def run(self, ids: torch.Tensor, max_new: int, lookup: bool) -> tuple[list[int], float]:
        kw = {"prompt_lookup_num_tokens": 8} if lookup else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids[None], max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos,
                                      pad_token_id=self.eos[0], attention_mask=torch.ones_like(ids[None]), **kw)
        dt = time.perf_counter() - t0
        return out[0, ids.shape[0]:].tolist(), dt


class _DraftClock:
    """Times the drafter's propose + extend calls (instance-level wrappers, removed on exit)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.seconds = drafter, 0.0

    def _wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def __enter__(self) -> _DraftClock:
        if self.drafter is not None:
            for name in ("propose", "extend"):
                setattr(self.drafter, name, self._wrap(getattr(self.drafter, name)))
        return self

    def __exit__(self, *exc) -> None:
        if self.drafter is not None:
            for name in ("propose", "extend"):
                self.drafter.__dict__.pop(name, None)


@dataclass
class SideStores:
    """``--prefix-cache-mb``: each side's own prefix cache (eyas.kv.prefix), kept across questions as a server
    keeps one, so neither side reuses what the other prefilled.
    """

    plain: PrefixStore
    spec: PrefixStore

    @classmethod
    def of(cls, mb: int) -> SideStores | None:
        return cls(PrefixStore.sized(mb), PrefixStore.sized(mb)) if mb > 0 else None


@contextlib.contextmanager
def _using(spec, store: PrefixStore | None):
    """Decode with ``store`` as the speculator's prefix cache."""
    before = getattr(spec, "prefix_cache", None)
    spec.prefix_cache = store
    try:
        yield
    finally:
        spec.prefix_cache = before


def conversation(spec, q: dict, params: dict, hf: HFPeer | None, llama=None, turns: str = "first",
                 stores: SideStores | None = None) -> Iterator[QuestionResult]:
    """The question's turns (the first, or ``all``) as results: each turn is asked in the conversation so far,
    the earlier turns answered by the plain reference's output (the same for every drafter: lossless).
    """
    messages: list[dict] = []
    for i, text in enumerate(q["turns"][:1] if turns == "first" else q["turns"]):
        messages.append({"role": "user", "content": text})
        res, answer = bench_question(spec, q, params, hf, llama, list(messages), stores)
        res.turn = i + 1
        messages.append({"role": "assistant", "content": answer})
        yield res


def bench_question(spec, q: dict, params: dict, hf: HFPeer | None, llama=None,
                   prompt: str | list[dict] | None = None,
                   stores: SideStores | None = None) -> tuple[QuestionResult, str]:
    """Plain in fast mode, plain in exact mode when on, and speculative, back to back. The speedup's baseline is
    the faster of the two plain runs (exact mode's compiled decode path can beat fast mode's). ``prompt``: the
    question's first turn when None. Returns the result and the reference's answer text.
    """
    prompt = q["turns"][0] if prompt is None else prompt
    with _using(spec, stores and stores.plain):
        fast_plain, ref = plain_runs(spec, prompt, params)
    plain = max(fast_plain, ref, key=lambda r: r.tokens_per_second)
    with _DraftClock(spec.drafter) as clock, _using(spec, stores and stores.spec):
        fast = spec.generate(prompt, **params)
    res = QuestionResult(
        # the speculative output's length (the exact reference's where identical): fast mode's own output may end
        # elsewhere (another rounding), and it is only the baseline's rate
        question_id=q.get("question_id"), new_tokens=fast.new_tokens,
        plain_tps=plain.tokens_per_second, spec_tps=fast.new_tokens / fast.seconds,
        mean_accepted=fast.mean_accepted, identical=ref.token_ids == fast.token_ids,
        agreement=_agreement(ref.token_ids, fast.token_ids),
        exact_plain_tps=ref.tokens_per_second if spec.exact else None, fast_plain_tps=fast_plain.tokens_per_second,
        steps=fast.steps, draft_seconds=clock.seconds, spec_seconds=fast.seconds,
        plain_prompt_tps=plain.prompt_tokens / plain.prefill_seconds if plain.prefill_seconds else 0.0,
        plain_decode_tps=(plain.new_tokens - 1) / max(plain.seconds - plain.prefill_seconds, 1e-9),
        spec_decode_tps=(fast.new_tokens - 1) / max(fast.seconds - fast.prefill_seconds, 1e-9),
        plain_ttft_s=plain.prefill_seconds, spec_ttft_s=fast.prefill_seconds,
        cached_tokens=getattr(fast, "cached_tokens", 0),
    )
    if llama is not None:
        run = llama.run(spec.encode(prompt).tolist(), params["max_new_tokens"], spec.stop_ids())
        res.llamacpp_prompt_tps, res.llamacpp_decode_tps = run.prompt_tps, run.decode_tps
        res.llamacpp_agreement = _agreement(ref.token_ids, run.token_ids)
    if hf is not None:
        ids = spec.encode(prompt)
        hf_ids, hf_s = hf.run(ids, params["max_new_tokens"], lookup=False)
        lk_ids, lk_s = hf.run(ids, params["max_new_tokens"], lookup=True)
        res.hf_tps, res.hf_lookup_tps = len(hf_ids) / hf_s, len(lk_ids) / lk_s
        res.hf_lookup_identical = lk_ids == hf_ids
    return res, ref.text


def run_speed(spec, questions: list[dict], params: dict, compare_hf: bool, warmup: int, settings: dict,
              compare_llamacpp: bool = False, turns: str = "first", prefix_cache_mb: int = 0) -> SpeedReport:
    hf = HFPeer(spec) if compare_hf else None
    llama = None
    if compare_llamacpp:
        from eyas.bench.llamacpp import LlamaCppPeer, gguf_of

        llama = LlamaCppPeer(gguf_of(spec), threads=torch.get_num_threads())
    for q in questions[:warmup]:  # untimed (no prefix cache: nothing of a question is stored before it runs)
        bench_question(spec, q, {**params, "max_new_tokens": 16}, hf, llama)
    report, stores = SpeedReport(settings=settings), SideStores.of(prefix_cache_mb)
    for q in tqdm(questions, desc="bench speed", unit="q", file=sys.stderr):
        report.questions.extend(conversation(spec, q, params, hf, llama, turns, stores))
    return report


def print_report(report: SpeedReport) -> None:
    print(f"{'id':>6} {'tokens':>6} {'plain t/s':>9} {'spec t/s':>9} {'speedup':>7} {'tau':>5} identical")
    for r in report.questions:
        qid = f"{r.question_id}/{r.turn}" if r.turn > 1 else str(r.question_id)
        print(f"{qid:>6} {r.new_tokens:>6} {r.plain_tps:>9.2f} {r.spec_tps:>9.2f} "
              f"{r.speedup:>7.2f} {r.mean_accepted:>5.2f} {r.identical}")
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if "llamacpp_weights_caveat" in summary:
        print(f"note: {summary['llamacpp_weights_caveat']}")


def output_projection(model) -> str | None:
    """How greedy decoding computed the target's logits (eyas.models.lm_screen.screen_state): "screened" (only the
    possible argmaxes exactly), "full", or None where no greedy forward asked or the backend has no such projection.
    """
    from eyas.models.lm_screen import screen_state

    return screen_state(getattr(model, "lm_head_proj", None))


def kernel_tuning(model) -> dict | None:
    """The bf16 block kernel's per-CPU options the target runs with (gguf_tuning.in_use) as a dict, or None."""
    from eyas.models.gguf_tuning import in_use

    t = in_use(model)
    return None if t is None else asdict(t)


def cmd_speed(a) -> int:
    from eyas.cli import _load, gen_params

    torch.manual_seed(0)
    questions = read_questions(a.questions, a.limit)
    spec = _load(a)
    params = gen_params(a)
    settings = {k: v for k, v in vars(a).items() if k != "func"}
    settings.update(machine=platform.machine(), cpu=cpu_model(), threads=torch.get_num_threads(),
                    torch=torch.__version__, dtype_used=str(spec.target.model.dtype).removeprefix("torch."),
                    exact=spec.exact, date=time.strftime("%Y-%m-%d"), tree_used=spec.drafter_spec.tree,
                    tree_choice=spec.tree_choice.to_dict() if spec.tree_choice is not None else None,
                    head_projections=head_projections(spec.drafter),
                    target_projections=target_projections(spec.target.model),
                    kernel_tuning=kernel_tuning(spec.target.model))
    report = run_speed(spec, questions, params, a.compare_hf, a.warmup, settings, a.compare_llamacpp,
                       a.turns, a.prefix_cache_mb)
    # decided at the first greedy forward (timed once per machine): "screened", "full", or None where never asked
    settings["output_projection"] = output_projection(spec.target.model)
    print_report(report)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report.to_dict(), indent=2))
    if a.plot:
        from eyas.bench.plot import plot_speed

        plot_speed(report.to_dict(), a.plot)
    return 0
