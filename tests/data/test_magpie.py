"""Magpie source: the target writes the request, then answers it; dedupe; resume after SIGKILL.

Same tiny fp32 Llama and word tokenizer as test_generate.py (template ``<|im_start|> user TEXT <|im_end|>``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.data.engine import Completion
from eyas.data.generate import GenConfig, NativeGenerator
from eyas.data.magpie import MagpieConfig, MagpieJobs, prompt_key, user_prefix
from eyas.data.output import OutputFile, Sink

REPO = Path(__file__).resolve().parents[2]


def _generate_helpers():
    """tests/data/test_generate.py loaded by path (pytest's importlib mode has no package imports)."""
    path = Path(__file__).resolve().with_name("test_generate.py")
    spec = importlib.util.spec_from_file_location("_eyas_data_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_h = _generate_helpers()
IM_END, data_main, plain, word_tokenizer = _h.IM_END, _h.data_main, _h.plain, _h.word_tokenizer
spec, model_dir = _h.spec, _h.model_dir  # fixtures


def test_user_prefix_is_the_template_up_to_the_user_text() -> None:
    tok = word_tokenizer()
    assert user_prefix(tok) == tok.convert_tokens_to_ids(["<|im_start|>", "user"])


def test_prompt_key_ignores_case_and_spacing() -> None:
    assert prompt_key("What is  2+2?\n") == prompt_key("what is 2+2?")
    assert prompt_key("what is 2+2?") != prompt_key("what is 2+3?")


def _magpie(spec, tmp_path, count: int, done=frozenset(), **cfg):
    gen = NativeGenerator(spec, GenConfig(max_new_tokens=5, batch_size=3), stop_ids=(IM_END,),
                          user_sampling=MagpieConfig(count=count).sampling)
    out = OutputFile(tmp_path / "m.jsonl")
    sink = Sink(out, gen.describe())
    return gen, MagpieJobs(gen, MagpieConfig(count=count, **cfg), set(done), sink), out, sink


def test_duplicates_and_empty_requests_are_drawn_again(spec, tmp_path) -> None:
    ids = word_tokenizer().convert_tokens_to_ids
    already = f"magpie:{prompt_key('w1 w2')}"
    gen, jobs, out, sink = _magpie(spec, tmp_path, count=3, done={already, "gsm8k:4"})
    assert jobs.remaining == 2  # one Magpie conversation is already in the file; gsm8k ids do not count
    draws = [jobs.next_job(), jobs.next_job()]
    assert jobs.next_job() is None  # two in flight cover the two missing
    assert all(d.mode == 1 and d.prompt == user_prefix(gen.tokenizer) for d in draws)
    assert jobs.done(draws[0], Completion(ids(["w1", "w2", "<|im_end|>"]), "stop")) is None  # in the file
    assert jobs.done(draws[1], Completion([IM_END], "stop")) is None  # empty request
    assert jobs.rejects == 2
    d = jobs.next_job()
    answer = jobs.done(d, Completion(ids(["w3", "w4"]), "length"))  # a request cut at max_user_tokens is kept
    # an accepted request's answer is its follow-up (mode 0, its chat prompt), continuing the request's row
    assert answer.mode == 0 and answer.prompt == spec.encode([{"role": "user", "content": "w3 w4"}]).tolist()
    assert answer.prompt[: len(d.prompt) + 2] == d.prompt + ids(["w3", "w4"])
    assert jobs.done(jobs.next_job(), Completion(ids(["w3", "w4"]), "stop")) is None  # the same request again
    assert jobs.rejects == 3
    assert jobs.done(answer, Completion(ids(["w9", "<|im_end|>"]), "stop")) is None
    out.close()
    rec = json.loads(out.path.read_text())
    assert rec["id"] == f"magpie:{prompt_key('w3 w4')}" and rec["source"] == "magpie"
    assert rec["generator"]["user_temperature"] == 1.0 and rec["generator"]["temperature"] == 0.0
    assert rec["messages"] == [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w9"}]
    assert jobs.written == 2 and jobs.remaining == 1


def test_magpie_run_in_the_engine(spec, tmp_path) -> None:
    gen, jobs, out, sink = _magpie(spec, tmp_path, count=7)
    gen.engine.generator.manual_seed(0)
    gen.run([], sink, jobs)
    out.close()
    recs = [json.loads(x) for x in out.path.read_text().splitlines()]
    assert len(recs) == 7 and len({r["id"] for r in recs}) == 7
    for r in recs:
        request = r["messages"][0]["content"]
        assert r["id"] == f"magpie:{prompt_key(request)}" and request
        # the answer is the target's greedy answer to the request (batched == unbatched, fp32)
        ids = spec.encode(r["messages"][:1]).tolist()
        ref = plain(spec, ids, 5, stop_ids=(IM_END,))
        assert r["messages"][1]["content"] == spec.tokenizer.decode([t for t in ref if t != IM_END])
    assert sink.generated_tokens > sum(r["usage"]["completion_tokens"] for r in recs)  # requests count too


def test_magpie_config_refuses_greedy_and_no_count() -> None:
    with pytest.raises(ValueError, match="temperature"):
        MagpieConfig(count=3, temperature=0.0)
    with pytest.raises(ValueError, match="--limit"):
        MagpieConfig(count=0)


def test_magpie_needs_limit(tmp_path) -> None:
    with pytest.raises(ValueError, match="--limit"):
        data_main("--prompts", "magpie", "--out", str(tmp_path / "o.jsonl"))


def test_magpie_resumes_after_sigkill_without_duplicates(model_dir, tmp_path) -> None:
    out = tmp_path / "magpie.jsonl"
    count = 300
    args = ["--prompts", "magpie", "--limit", str(count), "--model", str(model_dir), "--dtype", "float32",
            "--max-new-tokens", "4", "--magpie-max-tokens", "4", "--batch-size", "2", "--seed", "3",
            "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eyas", "data", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 5:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    before = [json.loads(x) for x in out.read_text().splitlines() if x.strip() and x.endswith("}")]
    assert 5 <= len(before) < count
    with open(out, "a") as f:  # a write the kill cut off
        f.write('{"id": "magpie:cut", "messages": [')
    assert data_main(*args) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == count
    assert len({r["id"] for r in recs}) == count
    assert len({prompt_key(r["messages"][0]["content"]) for r in recs}) == count  # no request twice
    assert [r["id"] for r in recs[: len(before)]] == [r["id"] for r in before]  # what was written stays
    assert data_main(*args) == 0  # complete: nothing more
    assert len(out.read_text().splitlines()) == count


def test_tiny_model_is_deterministic_given_the_seed(spec, tmp_path) -> None:
    runs = []
    for k in range(2):
        gen, jobs, out, sink = _magpie(spec, tmp_path / str(k), count=4)
        gen.engine.generator.manual_seed(11)
        gen.run([], sink, jobs)
        out.close()
        runs.append([json.loads(x)["id"] for x in out.path.read_text().splitlines()])
    assert runs[0] == runs[1]
