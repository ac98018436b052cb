"""`eyas bench load`: statistics on hand-built records, stream parsing, failing servers, a live server."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from eyas.bench.load import LoadConfig, base_url, count_tokens, run_load
from eyas.bench.load_client import Side, _on_event, request_body
from eyas.bench.load_stats import (
    STATS,
    Chunk,
    RequestRecord,
    break_even,
    compare_levels,
    format_comparison,
    format_level,
    level_metrics,
    summarize,
)

METRICS = (
    "time_to_first_token_ms",
    "inter_token_latency_ms",
    "request_latency_ms",
    "output_sequence_length",
    "input_sequence_length",
)


def record(i, start, latency, times, osl, isl=10, error=None, spec=None) -> RequestRecord:
    r = RequestRecord(index=i, prompt_index=0, start=start, latency=latency, error=error, spec=spec)
    r.chunks = [Chunk(t, "x") for t in times]
    r.osl, r.isl = osl, isl
    r.finish_reason = None if error else "length"
    return r


# ---- statistics -------------------------------------------------------------------------------
def test_summarize_matches_numpy_linear_percentiles():
    s = summarize([1.0, 2.0, 3.0, 4.0, None])
    assert list(s) == list(STATS)
    assert s == pytest.approx(
        {"avg": 2.5, "min": 1, "max": 4, "p50": 2.5, "p75": 3.25, "p90": 3.7, "p99": 3.97}
    )
    assert summarize([0.25], 1e3) == {k: 250.0 for k in STATS}
    assert summarize([None]) is None and summarize([]) is None


def test_itl_is_genai_perf_definition():
    # the docstring's worked example: TTFT 100 ms, latency 310 ms, 5 tokens -> (310 - 100) / 4
    r = record(0, 0.0, 0.31, [0.10, 0.15, 0.30], osl=5)
    assert r.ttft == pytest.approx(0.10)
    assert r.itl == pytest.approx(0.0525)
    assert record(1, 0.0, 0.2, [0.1], osl=1).itl is None  # one token: no inter-token gap
    assert record(2, 0.0, 0.2, [], osl=0).ttft is None


def test_level_metrics_throughput_errors_and_tau():
    recs = [
        record(0, 10.0, 1.0, [0.2, 0.5], osl=10, spec={"steps": 4, "accepted": 6}),
        record(1, 10.5, 1.5, [0.3, 0.9], osl=20, isl=30, spec={"steps": 6, "accepted": 4}),
        record(2, 11.0, 0.5, [], osl=None, error="HTTP 500: boom"),  # failed: counted, not in the stats
    ]
    m = level_metrics(recs)
    assert (m["requests"], m["errors"], m["error_messages"]) == (3, 1, ["HTTP 500: boom"])
    assert m["wall_seconds"] == pytest.approx(2.0)  # 10.0 -> 12.0 (the second request ends last)
    assert m["output_token_throughput"] == pytest.approx(30 / 2.0)
    assert m["request_throughput"] == pytest.approx(2 / 2.0)
    assert m["time_to_first_token_ms"]["avg"] == pytest.approx(250.0)
    assert m["time_to_first_token_ms"]["max"] == pytest.approx(300.0)
    itls = [(1.0 - 0.2) / 9 * 1e3, (1.5 - 0.3) / 19 * 1e3]
    assert m["inter_token_latency_ms"]["avg"] == pytest.approx(sum(itls) / 2)
    assert m["request_latency_ms"]["min"] == pytest.approx(1000.0)
    assert m["input_sequence_length"]["avg"] == pytest.approx(20.0)
    assert m["mean_accepted_length"] == pytest.approx(1 + 10 / 10)
    assert m["server_output_sequence_length"] is None  # no usage, no token_ids


def test_level_metrics_all_failed():
    m = level_metrics([record(0, 0.0, 0.1, [], osl=None, error="HTTP 404: no such model")])
    assert m["errors"] == 1 and all(m[k] is None for k in METRICS)
    assert m["output_token_throughput"] == 0.0 and m["mean_accepted_length"] is None
    assert "N/A" in format_level("t", m) and "errors 1/1" in format_level("t", m)


def _level(c, tput, itl, ttft):
    stat = lambda v: {k: v for k in STATS}  # noqa: E731
    metrics = {
        "output_token_throughput": tput,
        "inter_token_latency_ms": stat(itl),
        "time_to_first_token_ms": stat(ttft),
        "request_latency_ms": stat(itl * 10),
    }
    return {"concurrency": c, "metrics": metrics}


def test_compare_levels_ratios_and_break_even():
    spec = [_level(1, 30.0, 20.0, 50.0), _level(4, 50.0, 40.0, 90.0), _level(16, 60.0, 80.0, 400.0)]
    plain = [_level(1, 15.0, 40.0, 50.0), _level(4, 55.0, 36.0, 90.0), _level(16, 70.0, 70.0, 300.0)]
    cmp = compare_levels(spec, plain)
    assert cmp["levels"][0]["output_throughput_ratio"] == pytest.approx(2.0)
    assert cmp["levels"][0]["itl_speedup"] == pytest.approx(2.0)
    assert cmp["levels"][2]["ttft_speedup"] == pytest.approx(0.75)
    assert cmp["break_even_concurrency"] == 4
    table = format_comparison({"speculative": spec, "plain": plain}, cmp)
    assert "stops paying" in [ln for ln in table.splitlines() if ln.strip().startswith("4 |")][0]


def test_break_even_ignores_a_noisy_loss_below_a_win():
    ratios = {1: 0.95, 2: 1.12, 4: 0.9, 8: 0.8}
    rows = [{"concurrency": c, "output_throughput_ratio": r} for c, r in ratios.items()]
    assert break_even(rows) == 4
    assert break_even(rows[:2]) is None  # still pays at the highest level
    assert break_even([{"concurrency": 1, "output_throughput_ratio": None}]) is None  # all failed: unknown


# ---- request building and stream parsing ----------------------------------------------------------
def test_config_and_request_body():
    assert base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ValueError, match="baseline-url"):
        LoadConfig(url="http://h:1", compare_speculation=True, eyas_fields=False)
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(url="http://h:1", concurrency=[0])
    cfg = LoadConfig(url="http://h:1", baseline_url="http://h:2", max_tokens=7)
    assert cfg.compare_speculation and cfg.requests_at(4) == 16
    body = request_body(cfg, Side("plain", cfg.url, "m", False), "hi")
    assert body["speculate"] is False and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 7
    assert "speculate" not in request_body(cfg, Side("plain", cfg.url, "m", None), "hi")


def test_stream_events_fill_the_record():
    r = RequestRecord(index=0, prompt_index=0)
    _on_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, r, True, 0.01)
    _on_event(
        {"choices": [{"delta": {"content": "Hel"}}], "eyas": {"token_ids": [5, 6], "num_accepted": 1}},
        r,
        True,
        0.1,
    )
    _on_event({"choices": [{"delta": {"content": "lo"}}]}, r, True, 0.2)  # a non-eyas server's chunk
    _on_event(
        {
            "choices": [{"delta": {}, "finish_reason": "stop"}],
            "eyas": {"token_ids": [5, 6, 7, 2], "steps": 2, "accepted": 1},
        },
        r,
        True,
        0.3,
    )
    _on_event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, r, True, 0.31)
    assert r.text == "Hello" and [c.t for c in r.chunks] == [0.1, 0.2]
    assert [c.server_tokens for c in r.chunks] == [2, None]
    assert r.finish_reason == "stop" and r.spec == {"steps": 2, "accepted": 1}
    assert (r.prompt_tokens, r.server_osl, r.ok) == (9, 4, True)
    _on_event({"error": {"message": "generation failed"}}, r, True, 0.4)
    assert r.error == "error event: generation failed"


# ---- failing servers ------------------------------------------------------------------------------
def _sse(events):
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def stub_app():
    """An OpenAI-style server whose behaviour is the requested model name."""
    app = FastAPI()
    content = {"choices": [{"delta": {"content": "one two"}, "finish_reason": None}]}
    finish = {"choices": [{"delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    streams = {
        "ok": [content, finish, usage, "[DONE]"],
        "cut": [content],  # the connection ends mid-answer
        "nofinish": [content, "[DONE]"],
        "error": [content, {"error": {"message": "generation failed"}}, "[DONE]"],
    }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "ok", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        model = (await request.json())["model"]
        if model not in streams:
            return JSONResponse(
                {"error": {"message": f"The model `{model}` does not exist"}}, status_code=404
            )
        return StreamingResponse(iter([_sse(streams[model])]), media_type="text/event-stream")

    return app


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


@pytest.fixture(scope="module")
def stub_url(serve):
    return serve(stub_app())


@pytest.mark.parametrize(
    "model, error",
    [
        ("ok", None),
        ("cut", "stream ended without [DONE]"),
        ("nofinish", "stream ended without a finish_reason"),
        ("error", "error event: generation failed"),
        ("missing", "HTTP 404: The model `missing` does not exist"),
    ],
)
def test_failures_are_counted_never_dropped(stub_url, monkeypatch, capsys, model, error):
    monkeypatch.setattr("eyas.bench.load.load_tokenizer", lambda name: WordTokenizer())
    cfg = LoadConfig(url=stub_url, concurrency=[2], requests=3, warmup=0, model=model, eyas_fields=False)
    m = run_load(cfg, ["a prompt"])["levels"]["default"][0]["metrics"]
    if error is None:
        assert (
            m["errors"] == 0
            and m["output_sequence_length"]["avg"] == 2
            and m["input_sequence_length"]["avg"] == 3
        )
    else:
        assert (m["requests"], m["errors"], m["error_messages"]) == (3, 3, [error])
        assert m["request_latency_ms"] is None and "errors 3/3" in capsys.readouterr().out


def test_cli_exit_code_on_errors(stub_url, monkeypatch, tmp_path):
    from eyas.cli import main

    monkeypatch.setattr("eyas.bench.load.load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "r.json"
    argv = ["bench", "load", "--url", stub_url, "--model", "cut", "--requests", "2", "--warmup", "0"]
    assert main(argv + ["--json", str(out), "--no-eyas-fields"]) == 1
    assert json.loads(out.read_text())["levels"]["default"][0]["metrics"]["errors"] == 2
    assert (
        main(["bench", "load", "--url", stub_url, "--requests", "1", "--no-eyas-fields"]) == 0
    )  # model "ok"
    assert main(["bench", "load", "--url", "ftp://x"]) == 2  # a user error: one line, exit 2


# ---- a live eyas server (embedded SmolLM2, fp32) -----------------------------------------------------------
@pytest.mark.slow
def test_live_sweep_compare_speculation(eyas_url, default_target, tmp_path, capsys):
    from eyas.cli import main

    out, png = tmp_path / "load.json", tmp_path / "load.png"
    argv = [
        "bench",
        "load",
        "--url",
        eyas_url,
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        "--max-tokens",
        "8",
        "--compare-speculation",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--records",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    print(table)  # shown with -s: the README's example
    report = json.loads(out.read_text())
    assert report["tokenizer"] == "SmolLM2-135M-Instruct"  # the served id resolves to the embedded tokenizer
    assert png.stat().st_size > 0 and "Speculative vs plain decoding" in table
    tok = default_target.tokenizer
    for side in ("speculative", "plain"):
        assert [lv["concurrency"] for lv in report["levels"][side]] == [1, 2]
        for lv in report["levels"][side]:
            m = lv["metrics"]
            assert m["errors"] == 0 and m["requests"] == 3
            assert all(m[k] is not None and set(m[k]) == set(STATS) for k in METRICS)
            assert m["output_token_throughput"] > 0 and m["request_throughput"] > 0
            assert (
                (m["mean_accepted_length"] > 1.0)
                if side == "speculative"
                else m["mean_accepted_length"] == 1.0
            )
            for r in lv["records"]:
                # OSL matches the server: usage = the streamed token_ids = the retokenized text
                # (the server also counts a stop token, which has no text)
                stop = r["finish_reason"] == "stop"
                streamed = sum(c["server_tokens"] for c in r["chunks"])
                assert r["server_osl"] == r["completion_tokens"] == streamed + stop
                assert r["osl"] == r["server_osl"] - stop
                assert r["osl"] == len(
                    tok.encode("".join(c["text"] for c in r["chunks"]), add_special_tokens=False)
                )
                assert r["isl"] == r["prompt_tokens"] > 0
    assert [r["concurrency"] for r in report["comparison"]["levels"]] == [1, 2]


@pytest.mark.slow
def test_live_wrong_model_is_an_error(eyas_url, capsys):
    from eyas.cli import main

    argv = [
        "bench",
        "load",
        "--url",
        eyas_url,
        "--model",
        "nope",
        "--tokenizer",
        "embedded",
        "--requests",
        "2",
        "--max-tokens",
        "4",
        "--warmup",
        "0",
    ]
    assert main(argv) == 1
    assert "HTTP 404: The model `nope` does not exist" in capsys.readouterr().out


def test_count_tokens_falls_back_to_the_chat_template(default_target):
    r = record(0, 0.0, 0.2, [0.1], osl=None)
    r.chunks[0].text = "Hello there"
    count_tokens([r], default_target.tokenizer, ["Hi!"], chat=True)
    assert r.osl == 2 and r.isl == len(
        default_target.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi!"}], add_generation_prompt=True
        )["input_ids"]
    )
