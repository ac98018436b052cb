"""Where an `eyas bench speed` ratio could still come from: its time split and what-ifs, from the recorded JSON alone.

    python scripts/ratio_budget.py docs/results/mtbench80_emr_screen.json [--target 1.7]

A run's end-to-end speedup is (plain prompt + plain decode) / (speculative prompt + speculative decode), summed over
its questions ("prompt": until the first token, i.e. prefill and that token). From the per-question rates and the
summary's per-step costs (draft = the drafter's calls, verify+commit = the rest of a step) it prints:

- prompt tokens a question, plain prompt ms a token and the prompts' share of plain time;
- the split itself, and the ratio with prompt processing left out of both sides (decode-only);
- the ratio if the speculative prompt cost what the plain one does (the draft head's pass over the prompt free);
- the ratio with the drafter's per-step cost scaled by 0.5 and 0 (a cheaper or a free head, the same τ);
- the τ that ``--target`` needs at these step costs (decode time taken as inversely proportional to τ: the same
  steps' cost, fewer of them).

Nothing is timed: the figures are the run's own, so they carry its host's noise.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass
class Split:
    plain_prompt: float  # seconds, summed over the questions
    plain_decode: float
    spec_prompt: float
    spec_decode: float
    draft_ms: float  # the drafter's per-step cost
    verify_ms: float  # verify + commit per step
    tau: float  # pooled mean accepted tokens per step
    prompt_tokens: float  # summed over the questions

    @property
    def ratio(self) -> float:
        return (self.plain_prompt + self.plain_decode) / (self.spec_prompt + self.spec_decode)

    def with_draft(self, scale: float) -> float:
        """The ratio with the drafter's per-step cost scaled by ``scale``."""
        step = self.draft_ms + self.verify_ms
        decode = self.spec_decode * (self.verify_ms + scale * self.draft_ms) / step
        return (self.plain_prompt + self.plain_decode) / (self.spec_prompt + decode)

    def tau_for(self, target: float) -> float:
        """The pooled τ at which the end-to-end ratio reaches ``target`` (same step costs, same prompts)."""
        room = (self.plain_prompt + self.plain_decode) / target - self.spec_prompt
        return float("inf") if room <= 0 else self.tau * self.spec_decode / room


def split_of(run: dict) -> Split:
    qs, s = run["questions"], run["summary"]
    if not all(q.get("plain_decode_tps") and q.get("spec_decode_tps") for q in qs):
        raise SystemExit("this JSON has no per-question decode rates (an `eyas bench speed` run before they were kept)")
    def prompt_s(q: dict, side: str) -> float:
        """A question's time to the first token: its whole time less its decode time (tokens after the first)."""
        return q["new_tokens"] / q[f"{side}_tps"] - (q["new_tokens"] - 1) / q[f"{side}_decode_tps"]

    plain_p = [prompt_s(q, "plain") for q in qs]
    spec_p = [prompt_s(q, "spec") for q in qs]
    decode = lambda key: sum((q["new_tokens"] - 1) / q[key] for q in qs)  # noqa: E731
    tokens = sum(q["plain_prompt_tps"] * p for q, p in zip(qs, plain_p, strict=True))  # prompt time x prompt rate
    return Split(sum(plain_p), decode("plain_decode_tps"), sum(spec_p), decode("spec_decode_tps"),
                 s["draft_ms_per_step"], s["verify_commit_ms_per_step"], s["mean_accepted"], tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="`eyas bench speed --json` files")
    ap.add_argument("--target", type=float, default=1.7, help="the end-to-end speedup to solve τ for")
    a = ap.parse_args()
    for path in a.runs:
        with open(path) as f:
            run = json.load(f)
        sp, n = split_of(run), len(run["questions"])
        same_prompt = (sp.plain_prompt + sp.plain_decode) / (sp.plain_prompt + sp.spec_decode)
        share = sp.plain_prompt / (sp.plain_prompt + sp.plain_decode)
        print(f"{path}: {sp.prompt_tokens / n:.0f} prompt tokens a question, plain prompt "
              f"{1e3 * sp.plain_prompt / sp.prompt_tokens:.2f} ms a token, {share:.0%} of plain time")
        print(f"  prompt / decode s: plain {sp.plain_prompt:.2f} / {sp.plain_decode:.2f}, speculative "
              f"{sp.spec_prompt:.2f} / {sp.spec_decode:.2f}; step: draft {sp.draft_ms:.2f} + verify "
              f"{sp.verify_ms:.2f} ms, τ {sp.tau:.3f}")
        print(f"  speedup {sp.ratio:.3f}x; decode-only {sp.plain_decode / sp.spec_decode:.3f}x; speculative prompt "
              f"as plain's {same_prompt:.3f}x; draft cost x0.5 {sp.with_draft(0.5):.3f}x, free "
              f"{sp.with_draft(0.0):.3f}x; {a.target:g}x needs τ {sp.tau_for(a.target):.3f}")


if __name__ == "__main__":
    main()
