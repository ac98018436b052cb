"""Multi-turn chats with and without the prefix cache (eyas.kv.prefix), alternating in one process.

Each question is one conversation: turn 1, its answer, turn 2 (MT-bench's two turns). "cold" decodes it with no
prefix cache; "warm" with one store kept for the whole run, as `eyas serve` keeps one: turn 1 finds the chat
template's system prompt stored by the questions before it, turn 2 finds turn 1's prompt. Per turn: prompt
tokens, reused tokens, time to the first token, the turn's time; and whether both give the same tokens (they
must: reuse runs in exact mode only, where it changes no bit). The two alternate which goes first per question.

python scripts/prefix_cache_ab.py --questions ../shared/data/mt_bench/question.jsonl --limit 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import eyas
from eyas.bench.speed import cpu_model, read_questions
from eyas.kv.prefix import PrefixStore


def conversation(spec, turns: list[str], max_new_tokens: int, store: PrefixStore | None) -> list[dict]:
    """Decode the turns in order, each answer fed back; per turn its figures and token ids."""
    spec.prefix_cache = store
    messages, out = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = spec.generate(messages, max_new_tokens=max_new_tokens)
        out.append({"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                    "ttft_s": r.prefill_seconds, "seconds": r.seconds, "token_ids": r.token_ids})
        messages.append({"role": "assistant", "content": r.text})
    return out


def run(spec, questions: list[dict], max_new_tokens: int, cache_mb: int) -> list[dict]:
    warm = PrefixStore.sized(cache_mb)
    conversation(spec, questions[0]["turns"][:1], 16, None)  # untimed: first-call allocations
    conversation(spec, questions[0]["turns"][:1], 16, PrefixStore())
    rows = []
    for i, q in enumerate(questions):
        sides = {}
        for side in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
            sides[side] = conversation(spec, q["turns"], max_new_tokens, warm if side == "warm" else None)
        for t, (c, w) in enumerate(zip(sides["cold"], sides["warm"], strict=True)):
            rows.append({"question_id": q.get("question_id"), "turn": t + 1, "prompt_tokens": c["prompt_tokens"],
                         "cached_tokens": w["cached_tokens"], "cold_ttft_s": c["ttft_s"], "warm_ttft_s": w["ttft_s"],
                         "cold_s": c["seconds"], "warm_s": w["seconds"],
                         "identical": c["token_ids"] == w["token_ids"]})
        print(f"{q.get('question_id')}: " + ", ".join(
            f"turn {r['turn']} {r['cached_tokens']}/{r['prompt_tokens']} reused, ttft {1e3 * r['cold_ttft_s']:.0f} "
            f"-> {1e3 * r['warm_ttft_s']:.0f} ms" for r in rows[-len(q["turns"]):]), file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {"identical": sum(r["identical"] for r in rows), "turns": len(rows)}
    for turn in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == turn]
        cold, warm = (statistics.mean(r[k] for r in rs) for k in ("cold_ttft_s", "warm_ttft_s"))
        out[f"turn{turn}"] = {
            "n": len(rs), "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rs),
            "reused_share": sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs),
            "cold_ttft_ms": round(1e3 * cold, 1), "warm_ttft_ms": round(1e3 * warm, 1),
            "ttft_ratio": round(cold / warm, 3),
        }
    out["conversation_time_ratio"] = round(sum(r["cold_s"] for r in rows) / sum(r["warm_s"] for r in rows), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", required=True, help="EAGLE/Spec-Bench jsonl with a 'turns' list per line")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it (exact mode)")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--cache-mb", type=int, default=256, help="the warm side's store (eyas serve's default)")
    ap.add_argument("--json", default=None, help="write settings, summary and per-turn rows here")
    a = ap.parse_args()
    spec = eyas.load(drafter=a.drafter, dtype=a.dtype)
    if not spec.exact:
        raise SystemExit("the prefix cache runs in exact mode only; this load is not exact (try --dtype bfloat16)")
    rows = run(spec, read_questions(a.questions, a.limit), a.max_new_tokens, a.cache_mb)
    settings = {"questions": a.questions, "limit": a.limit, "max_new_tokens": a.max_new_tokens,
                "dtype": str(spec.target.model.dtype).removeprefix("torch."), "drafter": a.drafter,
                "cache_mb": a.cache_mb, "cpu": cpu_model(), "threads": torch.get_num_threads(),
                "torch": torch.__version__}
    result = {"settings": settings, "summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
