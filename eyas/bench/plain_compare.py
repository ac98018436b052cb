"""``eyas generate --compare-plain``: speculative against plain decoding of one prompt, timed in interleaved rounds.

One run of each side is at the mercy of whatever else the machine does during its second or two (on a shared
2-core VM one run of the README command measured 1.45x and the next 1.61x, the plain side moving 42 -> 54 tok/s).
So each side runs ``repeats`` times, alternating (plain fast mode, plain exact mode, speculative per round), and the
report is the median tok/s of each side and their ratio, with the per-round ratios' range beside it. The baseline
of a round is its faster plain mode (exact mode's compiled decode path can beat fast mode's, as in ``eyas bench
speed``); the reference the output must equal is plain decoding in the speculator's own numerics mode.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class PlainComparison:
    """Medians over interleaved rounds; ``ratios`` is each round's speculative / plain tok/s."""

    plain_tps: float
    spec_tps: float
    ratios: list[float]
    identical: bool  # every speculative run's ids equal plain decoding's (the reference mode)
    reference_ids: list[int] = field(repr=False)

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps

    def to_dict(self) -> dict:
        return {"tokens_per_second": self.plain_tps, "spec_tokens_per_second": self.spec_tps,
                "speedup": self.speedup, "speedup_runs": [round(r, 4) for r in self.ratios],
                "rounds": len(self.ratios), "identical": self.identical, "token_ids": self.reference_ids}

    def summary(self) -> str:
        spread = f"{min(self.ratios):.2f}-{max(self.ratios):.2f}x" if len(self.ratios) > 1 else "one run"
        same = "identical" if self.identical else "DIFFERENT"
        return (f"[plain decoding: {self.plain_tps:.1f} tok/s, speculative {self.spec_tps:.1f} tok/s (medians of "
                f"{len(self.ratios)} interleaved runs) -> speedup {self.speedup:.2f}x (runs: {spread}); output {same} "
                f"to plain decoding (what --drafter none produces)]")


def plain_runs(spec, prompt, params: dict, chat: bool = True):
    """Plain decoding of ``prompt`` in fast mode and, where the speculator runs exact mode, in exact mode:
    (fast, reference). The faster of the two is a speedup's baseline (exact mode's compiled decode path can beat fast
    mode's); the reference, plain decoding in the speculator's own numerics, is what its output must equal.
    """
    fast = spec.generate(prompt, chat=chat, speculate=False, exact=False, **params)
    return fast, spec.generate(prompt, chat=chat, speculate=False, **params) if spec.exact else fast


def compare_plain(spec, prompt, chat: bool, params: dict, first_spec: tuple[float, list[int]],
                  repeats: int = 3) -> PlainComparison:
    """Time plain decoding ``repeats`` times and speculative decoding ``repeats - 1`` more times, interleaved.

    first_spec: (tok/s, ids) of the speculative run already made (the streamed one, or ``--json``'s).
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    spec_tps, plain_tps, ratios = [first_spec[0]], [], []
    ids_seen, ref_ids = [first_spec[1]], None
    for r in range(repeats):
        fast, ref = plain_runs(spec, prompt, params, chat)
        ref_ids = ref.token_ids if ref_ids is None else ref_ids
        plain_tps.append(max(fast.tokens_per_second, ref.tokens_per_second))
        if r > 0:
            out = spec.generate(prompt, chat=chat, **params)
            spec_tps.append(out.tokens_per_second)
            ids_seen.append(out.token_ids)
        ratios.append(spec_tps[r] / plain_tps[r])
    return PlainComparison(plain_tps=statistics.median(plain_tps), spec_tps=statistics.median(spec_tps),
                           ratios=ratios, identical=all(ids == ref_ids for ids in ids_seen), reference_ids=ref_ids)
