"""``eyas generate --compare-plain``'s interleaved rounds (eyas.bench.plain_compare) on a scripted speculator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from eyas.bench.plain_compare import compare_plain


@dataclass
class _Out:
    token_ids: list[int]
    tokens_per_second: float


class _Scripted:
    """generate() hands out the next scripted result of its kind and records the call order."""

    exact = True

    def __init__(self, fast, exact, spec):
        self.queues = {"fast": list(fast), "exact": list(exact), "spec": list(spec)}
        self.calls = []

    def generate(self, prompt, chat=True, speculate=True, exact=None, **params):
        kind = "spec" if speculate else "fast" if exact is False else "exact"
        self.calls.append(kind)
        return self.queues[kind].pop(0)


def test_medians_of_interleaved_rounds():
    ids = [1, 2, 3]
    s = _Scripted(fast=[_Out(ids, 40.0), _Out(ids, 50.0), _Out(ids, 30.0)],
                  exact=[_Out(ids, 45.0), _Out(ids, 20.0), _Out(ids, 35.0)],
                  spec=[_Out(ids, 90.0), _Out(ids, 60.0)])
    c = compare_plain(s, "p", True, {}, (80.0, ids), repeats=3)
    # the speculative run already made comes first; then plain, plain, speculative per later round
    assert s.calls == ["fast", "exact", "fast", "exact", "spec", "fast", "exact", "spec"]
    assert c.plain_tps == 45.0  # median of each round's faster plain mode: 45, 50, 35
    assert c.spec_tps == 80.0  # median of 80, 90, 60
    assert c.ratios == pytest.approx([80 / 45, 90 / 50, 60 / 35])
    assert c.speedup == pytest.approx(80 / 45) and c.identical
    d = c.to_dict()
    assert d["rounds"] == 3 and d["token_ids"] == ids and d["speedup"] == pytest.approx(80 / 45)
    assert "medians of 3 interleaved runs" in c.summary() and "identical" in c.summary()


def test_a_differing_speculative_run_is_reported():
    ids = [1, 2, 3]
    s = _Scripted(fast=[_Out(ids, 40.0)] * 2, exact=[_Out(ids, 40.0)] * 2, spec=[_Out([1, 2, 4], 60.0)])
    c = compare_plain(s, "p", True, {}, (60.0, ids), repeats=2)
    assert not c.identical and "DIFFERENT" in c.summary()


def test_one_round_and_bad_repeats():
    ids = [7]
    s = _Scripted(fast=[_Out(ids, 10.0)], exact=[_Out(ids, 20.0)], spec=[])
    c = compare_plain(s, "p", True, {}, (30.0, ids), repeats=1)
    assert c.speedup == pytest.approx(1.5) and "one run" in c.summary()
    with pytest.raises(ValueError, match="at least 1"):
        compare_plain(s, "p", True, {}, (30.0, ids), repeats=0)
