"""eyas bench forward (verify-cost curve) and the llama.cpp peer of eyas bench speed."""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path

import pytest
import torch

from eyas.bench.forward import plot_forward, run_forward
from eyas.bench.speed import QuestionResult, SpeedReport, cpu_model


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_run_forward_times_fast_and_exact_mode(tiny, dtype, tmp_path):
    model = tiny.native("llama", seed=0).to(dtype)
    result = run_forward(model, [1, 3, 5], prefix=40, repeats=2, exact_too=True)
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [1, 3, 5]
    assert all(r["ms"] > 0 and r["exact_ms"] > 0 for r in rows)
    assert rows[0]["relative"] == 1.0
    plot_forward({**result, "settings": {"dtype_used": "bf16"}}, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_model_names_the_isa():
    name = cpu_model()
    assert "(" in name and name.endswith(")")


def test_llamacpp_peer_missing_is_a_clear_error(monkeypatch):
    from eyas.bench.llamacpp import LlamaCppPeer

    real = builtins.__import__

    def no_llama(name, *a, **k):
        if name == "llama_cpp":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        LlamaCppPeer(Path("x.gguf"), threads=1)


def test_gguf_of_refuses_a_non_gguf_target():
    from eyas.bench.llamacpp import gguf_of

    class T:
        name = "/some/hf/dir"

    class S:
        target = T()

    with pytest.raises(ValueError, match="needs a GGUF target"):
        gguf_of(S())


def test_summary_reports_prompt_and_decode_rates_apart():
    rows = [QuestionResult(question_id=i, new_tokens=10, plain_tps=20.0, spec_tps=30.0, mean_accepted=2.0,
                           identical=True, agreement=1.0, plain_prompt_tps=1000.0, plain_decode_tps=d,
                           llamacpp_prompt_tps=400.0, llamacpp_decode_tps=100.0) for i, d in enumerate((50.0, 25.0))]
    s = SpeedReport(settings={}, questions=rows).summary()
    assert s["eyas_plain_decode_tokens_per_second"] == pytest.approx(2 / (1 / 50 + 1 / 25))
    assert s["llamacpp_decode_tokens_per_second"] == pytest.approx(100.0)
    assert s["eyas_plain_decode_vs_llamacpp"] == pytest.approx(2 / (1 / 50 + 1 / 25) / 100)
    assert "Q4_1" in s["llamacpp_weights_caveat"] and "4x fewer" in s["llamacpp_weights_caveat"]
    # a target whose projections read the GGUF blocks streams the same bytes as llama.cpp: the caveat says so
    s = SpeedReport(settings={"target_projections": {"gguf_blocks": 121, "dense": 0}}, questions=rows).summary()
    assert "both read" in s["llamacpp_weights_caveat"] and "4x fewer" not in s["llamacpp_weights_caveat"]


def test_summary_reports_the_decode_only_speedup_beside_the_end_to_end_one():
    # question 0: 11 tokens, decode 10 after the first at 50 vs 100 tok/s; question 1: 21 tokens, 20 at 40 vs 50
    rows = [QuestionResult(question_id=0, new_tokens=11, plain_tps=40.0, spec_tps=60.0, mean_accepted=2.0,
                           identical=True, agreement=1.0, plain_decode_tps=50.0, spec_decode_tps=100.0),
            QuestionResult(question_id=1, new_tokens=21, plain_tps=35.0, spec_tps=40.0, mean_accepted=1.5,
                           identical=True, agreement=1.0, plain_decode_tps=40.0, spec_decode_tps=50.0)]
    s = SpeedReport(settings={}, questions=rows).summary()
    assert s["decode_speedup"] == pytest.approx((10 / 50 + 20 / 40) / (10 / 100 + 20 / 50))
    assert s["speedup"] == pytest.approx((11 / 40 + 21 / 35) / (11 / 60 + 21 / 40))
    assert s["speedup_mean_tps"] == pytest.approx((60 + 40) / (40 + 35))  # Spec-Bench's: faster answers weigh more
    assert "mean_accepted_pooled" not in s  # no step counts (older JSON): no pooled tau, the questions' mean
    assert s["mean_accepted"] == s["mean_accepted_per_question"] == pytest.approx(1.75)
    rows[0].steps, rows[1].steps = 5, 12  # 5 accepted over 5 steps, 6 over 12
    s = SpeedReport(settings={}, questions=rows).summary()
    # Spec-Bench's tau: every step weighs the same, so the question with more steps (and a lower tau) weighs more
    assert s["mean_accepted"] == s["mean_accepted_pooled"] == pytest.approx(1 + 11 / 17)
    assert s["mean_accepted_per_question"] == pytest.approx(1.75)
    assert "plain_ttft_ms" not in s  # no time to first token recorded (older JSON)
    rows[0].plain_ttft_s, rows[0].spec_ttft_s, rows[1].plain_ttft_s, rows[1].spec_ttft_s = 0.05, 0.06, 0.15, 0.16
    s = SpeedReport(settings={}, questions=rows).summary()
    assert s["plain_ttft_ms"] == pytest.approx(100.0) and s["spec_ttft_ms"] == pytest.approx(110.0)
    assert s["prompt_share_of_plain_time"] == pytest.approx(0.2 / (11 / 40 + 21 / 35))
    rows[1].spec_decode_tps = 0.0  # a result without the split (older JSON): no decode-only figure
    assert "decode_speedup" not in SpeedReport(settings={}, questions=rows).summary()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is an optional peer")
def test_llamacpp_peer_decodes_greedily_past_one_batch_of_prompt():
    from eyas.bench.llamacpp import LlamaCppPeer
    from eyas.models.loading import embedded_gguf_path

    peer = LlamaCppPeer(embedded_gguf_path(), threads=1)
    llm = peer.llm
    france = llm.tokenize(b"The capital of France is")
    run = peer.run(france, 3, stop_ids=())
    assert llm.detokenize(run.token_ids[:1]) == b" Paris"  # the model's greedy token, not token 0 (unwritten scores)
    long = llm.tokenize(b"one two three four five six seven eight " * 80)  # > n_batch (512) prompt tokens
    assert len(long) > 512
    run = peer.run(long, 20, stop_ids=())
    assert len(run.token_ids) == 20 and len(set(run.token_ids)) > 1 and run.decode_tps > 0


def test_a_question_counts_the_speculative_outputs_tokens_when_fast_mode_ends_elsewhere(monkeypatch):
    """Fast-mode plain decoding rounds otherwise and may stop at another length; when it is the faster baseline
    only its rate counts: the question's tokens are the speculative output's (= the exact reference's)."""
    from types import SimpleNamespace

    from eyas.bench import speed

    def run(ids, seconds):
        return SimpleNamespace(token_ids=ids, new_tokens=len(ids), tokens_per_second=len(ids) / seconds,
                               seconds=seconds, prefill_seconds=0.01, prompt_tokens=5, mean_accepted=2.0, steps=3,
                               text=f"{len(ids)} tokens")

    exact = list(range(23))
    fast_plain, ref, spec_out = run(list(range(63)), 1.0), run(exact, 0.5), run(exact, 0.3)
    monkeypatch.setattr(speed, "plain_runs", lambda spec, prompt, params: (fast_plain, ref))
    spec = SimpleNamespace(exact=True, drafter=None, generate=lambda prompt, **p: spec_out)
    r, answer = speed.bench_question(spec, {"question_id": 1, "turns": ["hi"]}, {}, None)
    assert r.new_tokens == 23 and r.identical and answer == "23 tokens"  # the exact reference's text
    assert r.plain_tps == pytest.approx(63.0)  # the faster plain run's rate is the baseline
    assert r.spec_tps == pytest.approx(23 / 0.3)


@pytest.mark.parametrize("turns", ["first", "all"])
def test_every_turn_is_asked_in_the_conversation_so_far(monkeypatch, turns):
    """--turns all: turn 2 is asked after turn 1 and the plain reference's answer to it (Spec-Bench's MT-bench)."""
    from types import SimpleNamespace

    from eyas.bench import speed

    asked = []

    def run(prompt, **params):
        asked.append(prompt)
        n = len(prompt)
        return SimpleNamespace(token_ids=[n], new_tokens=1, tokens_per_second=10.0, seconds=0.1, prefill_seconds=0.01,
                               prompt_tokens=5, mean_accepted=1.0, steps=1, text=f"answer to {n} messages")

    monkeypatch.setattr(speed, "plain_runs", lambda spec, prompt, params: (run(prompt), run(prompt)))
    spec = SimpleNamespace(exact=True, drafter=None, generate=lambda prompt, **p: run(prompt))
    q = {"question_id": 7, "turns": ["first question", "second question"]}
    results = list(speed.conversation(spec, q, {}, None, turns=turns))
    assert [r.turn for r in results] == ([1, 2] if turns == "all" else [1])
    assert all(r.identical and r.question_id == 7 for r in results)
    assert asked[0] == [{"role": "user", "content": "first question"}]
    if turns == "all":
        assert asked[-1] == [{"role": "user", "content": "first question"},
                             {"role": "assistant", "content": "answer to 1 messages"},
                             {"role": "user", "content": "second question"}]


def test_each_side_decodes_with_its_own_prefix_cache(monkeypatch):
    """--prefix-cache-mb: plain and speculative decoding each keep a store, so neither reuses the other's prefill."""
    from types import SimpleNamespace

    from eyas.bench import speed

    seen = []

    def run(prompt, **params):
        seen.append(spec.prefix_cache)
        return SimpleNamespace(token_ids=[1], new_tokens=1, tokens_per_second=10.0, seconds=0.1, prefill_seconds=0.01,
                               prompt_tokens=5, mean_accepted=1.0, steps=1, text="a", cached_tokens=3)

    monkeypatch.setattr(speed, "plain_runs", lambda spec, prompt, params: (run(prompt), run(prompt)))
    spec = SimpleNamespace(exact=True, drafter=None, generate=lambda prompt, **p: run(prompt), prefix_cache="mine")
    stores = speed.SideStores.of(1)
    (res,) = speed.conversation(spec, {"question_id": 1, "turns": ["q"]}, {}, None, stores=stores)
    assert seen == [stores.plain, stores.plain, stores.spec] and stores.plain is not stores.spec
    assert spec.prefix_cache == "mine" and res.cached_tokens == 3  # restored; the speculative run's reuse recorded
    assert speed.SideStores.of(0) is None


def test_head_projections_counts_the_heads_kinds_through_a_hybrid_drafter():
    from types import SimpleNamespace

    from torch import nn

    from eyas.bench.speed import head_projections
    from eyas.models.gguf_blocks import GGUFBlocks

    head = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8), nn.Linear(8, 4))
    head[0].__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.zeros(32, 68, dtype=torch.uint8), qtype=8, k=64)
    hybrid = SimpleNamespace(head=SimpleNamespace(head=head))  # HybridDrafter -> Eagle3Drafter -> module
    assert head_projections(hybrid) == {"int8": 0, "q8_0": 1, "dense": 2}
    assert head_projections(SimpleNamespace()) is None  # n-gram lookup: no head
    assert head_projections(None) is None
