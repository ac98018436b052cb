"""``eyas data`` generation: batched == unbatched greedy, multi-turn, stops, resume, remote.

The target is a tiny random fp32 Llama (tests/conftest.py) with a word-level
tokenizer ("w0".."w249" plus chat tokens) and a ChatML-like template, so prompts
of any length are easy to write and answers decode back to the same words.
The remote mode runs against a stub OpenAI server on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eyas.api import Speculator
from eyas.data.command import add_data_parser
from eyas.data.engine import EngineConfig, Job, RefillEngine
from eyas.data.generate import GenConfig, NativeGenerator
from eyas.data.output import OutputFile, Sink
from eyas.data.remote import RemoteConfig, RemoteGenerator, base_url
from eyas.data.sources import Conversation
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.loading import DrafterSpec
from eyas.models.loading import LoadedTarget
from eyas.types import SamplingParams

IM_END = 252  # the word-level tokenizer's <|im_end|>
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(250)}
    for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]):
        vocab[t] = 250 + i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = TEMPLATE
    return tok


def words(n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 250, (n,), generator=g))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


_BUILT: dict[str, object] = {}  # built once per module; the ``tiny`` fixture is function-scoped


@pytest.fixture
def spec(tiny) -> Speculator:
    """A plain-decoding Speculator on the tiny fp32 Llama with the word tokenizer."""
    if "spec" not in _BUILT:
        target = LoadedTarget(model=tiny.native("llama"), tokenizer=word_tokenizer(), path=Path("."),
                              name="tiny")
        _BUILT["spec"] = Speculator(target, DrafterSpec("none"))
    return _BUILT["spec"]


def plain(spec: Speculator, ids: list[int], n: int, stop_ids=()) -> list[int]:
    """Unbatched plain greedy decoding (the reference every batched row must equal)."""
    dec = SpecDecoder(spec.target.model, None, DecodeConfig(max_new_tokens=n, stop_ids=tuple(stop_ids)))
    return [t for ev in dec.generate(torch.tensor(ids)) for t in ev.tokens.tolist()]


def prompts(spec: Speculator, lengths=(1, 4, 13, 13, 30, 57)) -> list[list[int]]:
    return [spec.encode([user(words(n, seed=n + k))]).tolist() for k, n in enumerate(lengths)]


# ---- the batch engine -------------------------------------------------------------------------------
def engine(spec, stop_ids=(), modes=None, **cfg) -> RefillEngine:
    args = (spec.target.model, stop_ids, EngineConfig(**cfg))
    return RefillEngine(*args) if modes is None else RefillEngine(*args, modes=modes)


# batch 2 / refill at 1: rows finish and are refilled while others decode (each row at its own length);
# prefill_rows 1 and chunk 5: one prompt per prefill, in several chunks
@pytest.mark.parametrize("cfg", [
    dict(batch_size=8), dict(batch_size=2, refill_at=1), dict(batch_size=3, prefill_rows=1, prefill_chunk=5),
    dict(batch_size=4, refill_at=4, prefill_rows=2, slots=8),  # the cache grows
])
def test_batched_equals_unbatched_greedy(spec, cfg) -> None:
    ps = prompts(spec)
    budgets = [24, 3, 17, 24, 9, 24]  # rows of different budgets finish at different steps
    eng = engine(spec, **cfg, max_new_tokens=24)
    jobs = _Jobs([Job(i, p, max_new_tokens=n) for i, (p, n) in enumerate(zip(ps, budgets, strict=True))])
    eng.run(jobs)
    for i, (p, n) in enumerate(zip(ps, budgets, strict=True)):
        assert jobs.results[i].token_ids == plain(spec, p, n)
        assert jobs.results[i].finish_reason == "length"
    if cfg["batch_size"] < len(ps):  # a job was taken after one finished while others were still decoding
        assert any(done and live for done, live in jobs.taken)


class _Turns:
    """Two-turn jobs: turn 2's prompt is turn 1's prompt + answer + a few tokens (key % 3 == 0: the
    row is reused), shares nothing with it (1: prefilled whole), or shares its first 3 tokens (2)."""

    def __init__(self, spec, ps) -> None:
        self.spec, self.todo, self.results = spec, [Job((i, 0), p) for i, p in enumerate(ps)], {}

    def next_job(self):
        return self.todo.pop(0) if self.todo else None

    def done(self, job, comp):
        self.results[job.key] = (job.prompt, comp)
        i, turn = job.key
        if turn == 1:
            return None
        extra = [spec_word(7 + i), spec_word(9)]
        prompt = [job.prompt + comp.token_ids + extra, [spec_word(5)] + job.prompt + extra,
                  job.prompt[:3] + [spec_word(250 - i)] + extra][i % 3]
        return Job((i, 1), prompt, max_new_tokens=6 + i)


def spec_word(n: int) -> int:
    return n  # word-level tokenizer: "w<n>" has id n


@pytest.mark.parametrize("cfg", [dict(batch_size=8), dict(batch_size=2, refill_at=1, prefill_rows=1),
                                 dict(batch_size=3, prefill_rows=2, prefill_chunk=3, slots=8)])
def test_follow_up_continues_in_its_row(spec, cfg) -> None:
    ps = prompts(spec)
    eng = engine(spec, **cfg, max_new_tokens=10)
    jobs = _Turns(spec, ps)
    eng.run(jobs)
    assert len(jobs.results) == 2 * len(ps)
    for (i, turn), (prompt, comp) in jobs.results.items():
        assert comp.token_ids == plain(spec, prompt, 10 if turn == 0 else 6 + i), (i, turn)
    fresh = sum(len(p) for p, _ in (jobs.results[(i, 0)] for i in range(len(ps))))
    second = [len(jobs.results[(i, 1)][0]) for i in range(len(ps))]
    # key % 3 == 0 fed only the answer's last token and the 2 extra ones (the row was reused), 1 all of
    # its prompt, 2 all but the 3 shared tokens
    assert eng.prefilled == fresh + sum([3, n, n - 3][i % 3] for i, n in enumerate(second))


def test_shared_prompt_is_prefilled_once(spec) -> None:
    p = prompts(spec, (9,))[0]
    eng = engine(spec, batch_size=2, refill_at=1, prefill_rows=1, max_new_tokens=5)
    jobs = _Jobs([Job(i, p, shared=True, max_new_tokens=3 + i) for i in range(5)])
    eng.run(jobs)
    for i in range(5):
        assert jobs.results[i].token_ids == plain(spec, p, 3 + i)
    # the first two rows prefill it whole (one forward each, before any copy exists), later rows feed 1 token
    assert eng.prefilled == 2 * len(p) + 3


class _Jobs:
    def __init__(self, jobs) -> None:
        self.todo, self.results, self.issued = list(jobs), {}, 0
        self.taken: list[tuple[int, int]] = []  # (jobs done, jobs live) when each job was taken

    def next_job(self):
        if not self.todo:
            return None
        self.taken.append((len(self.results), self.issued - len(self.results)))
        self.issued += 1
        return self.todo.pop(0)

    def done(self, job, comp) -> None:
        self.results[job.key] = comp


def test_stop_ids_end_rows_and_finished_rows_leave_the_batch(spec) -> None:
    ps = prompts(spec)
    refs = [plain(spec, p, 20) for p in ps]
    stop = refs[2][3]  # a token row 2 emits at step 4: it must stop there, other rows maybe elsewhere
    gen = engine(spec, (stop,), max_new_tokens=20, batch_size=3, refill_at=1)
    out = gen.generate(ps)
    for p, ref, comp in zip(ps, refs, out, strict=True):
        assert comp.token_ids == plain(spec, p, 20, stop_ids=(stop,))
        expect = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert comp.token_ids == expect
        assert comp.finish_reason == ("stop" if stop in ref else "length")
    assert len(out[2].token_ids) <= 4 and out[2].finish_reason == "stop"


def test_context_end_caps_the_budget(spec) -> None:
    ctx = spec.target.model.config.max_position_embeddings  # 512
    long_prompt = spec.encode([user(words(ctx - 13, seed=3))]).tolist()  # 5 template tokens + ctx-13 words
    gen = engine(spec, max_new_tokens=32)
    short = prompts(spec, (5,))[0]
    out = gen.generate([long_prompt, short])
    assert len(out[0].token_ids) == ctx - len(long_prompt) == 8 and out[0].finish_reason == "length"
    assert out[0].token_ids == plain(spec, long_prompt, 8)
    assert out[1].token_ids == plain(spec, short, 32)


def test_max_slots_caps_the_budget_and_the_cache(spec) -> None:
    long_prompt, short = prompts(spec, (30, 3))
    eng = engine(spec, max_new_tokens=32, max_slots=len(long_prompt) + 6, slots=8)
    out = eng.generate([long_prompt, short])
    assert out[0].token_ids == plain(spec, long_prompt, 6) and out[0].finish_reason == "length"
    assert out[1].token_ids == plain(spec, short, 32)
    with pytest.raises(ValueError, match="room"):
        engine(spec, max_slots=len(long_prompt)).generate([long_prompt])


def test_sampling_is_seeded(spec) -> None:
    ps = prompts(spec, (3, 9))

    def draw(seed: int) -> list[list[int]]:
        eng = engine(spec, modes=[SamplingParams(1.0, 0, 0.9)], max_new_tokens=12, seed=seed)
        return [c.token_ids for c in eng.generate(ps)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


# ---- conversations ---------------------------------------------------------------------------------
def _run_native(spec, convs, tmp_path, batch_size=2, stop_ids=(IM_END,), max_new=16) -> dict[str, dict]:
    out = OutputFile(tmp_path / "out.jsonl")
    gen = NativeGenerator(spec, GenConfig(max_new_tokens=max_new, batch_size=batch_size), stop_ids=stop_ids)
    sink = Sink(out, gen.describe())
    gen.run(convs, sink)
    out.close()
    lines = [json.loads(line) for line in out.path.read_text().splitlines()]
    return {r["id"]: r for r in lines}


def test_multi_turn_uses_own_answers(spec, tmp_path) -> None:
    system = {"role": "system", "content": "w9"}
    turns = [[system, user(words(6, 1))], [user(words(3, 2))], [user(words(9, 3))]]
    convs = [Conversation("t:0", "t", turns), Conversation("t:1", "t", [[user(words(20, 4))]]),
             Conversation("t:2", "t", [[user(words(2, 5))], [user(words(2, 6))]])]
    recs = _run_native(spec, convs, tmp_path)
    assert set(recs) == {"t:0", "t:1", "t:2"}
    for conv in convs:  # reference: sequential unbatched greedy, turn k sees answers 0..k-1
        messages, usage = [], 0
        for turn in conv.turns:
            messages += turn
            ids = spec.encode(messages).tolist()
            new = plain(spec, ids, 16, stop_ids=(IM_END,))
            answer = spec.tokenizer.decode([t for t in new if t != IM_END], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            usage += len(ids)
        rec = recs[conv.id]
        assert rec["messages"] == messages
        assert rec["usage"]["prompt_tokens"] == usage
        assert len(rec["finish_reasons"]) == len(conv.turns)
        assert rec["generator"]["backend"] == "eyas-native" and rec["generator"]["temperature"] == 0.0


def test_too_long_conversation_is_skipped(spec, tmp_path) -> None:
    ctx = spec.target.model.config.max_position_embeddings
    convs = [Conversation("t:0", "t", [[user(words(ctx, 1))]]), Conversation("t:1", "t", [[user("w1")]])]
    out = OutputFile(tmp_path / "o.jsonl")
    gen = NativeGenerator(spec, GenConfig(max_new_tokens=4))
    sink = Sink(out, gen.describe())
    gen.run(convs, sink)
    out.close()
    assert [s[0] for s in sink.skipped] == ["t:0"] and "context" in sink.skipped[0][1]
    assert [json.loads(x)["id"] for x in out.path.read_text().splitlines()] == ["t:1"]


# ---- the command: resume after a kill --------------------------------------------------------------
def data_main(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="eyas")
    add_data_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["data", *argv])
    return args.func(args)


@pytest.fixture
def model_dir(tiny, tmp_path) -> Path:
    """The tiny model saved as a HF directory with the word tokenizer (what --model loads)."""
    d = tmp_path / "tiny_chat_model"
    tiny.hf("llama").save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    return d


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [user(words(2 + 3 * i, i))]} for i in range(6)]
    rows.append({"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"},
                                   {"from": "human", "value": "w4"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_command_resumes_after_a_kill(model_dir, prompt_file, tmp_path, capsys) -> None:
    common = ("--prompts", str(prompt_file), "--model", str(model_dir), "--dtype", "float32",
              "--max-new-tokens", "8", "--batch-size", "3")
    full = tmp_path / "full.jsonl"
    assert data_main(*common, "--out", str(full)) == 0
    summary = capsys.readouterr().out
    assert "data: 7 conversations" in summary and "tok/s" in summary
    lines = full.read_text().splitlines()
    assert len(lines) == 7
    # a SIGKILL mid-write leaves whole lines plus a cut-off one
    killed = tmp_path / "killed.jsonl"
    killed.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    assert data_main(*common, "--out", str(killed)) == 0
    assert "resuming, 2 of 7" in capsys.readouterr().err
    resumed = [json.loads(x) for x in killed.read_text().splitlines()]
    assert len(resumed) == 7 and len({r["id"] for r in resumed}) == 7
    assert {r["id"]: r for r in resumed} == {r["id"]: r for r in map(json.loads, lines)}
    assert data_main(*common, "--out", str(killed)) == 0  # all done: nothing loaded, nothing written
    assert "nothing to do" in capsys.readouterr().out


def test_output_file_repairs_only_a_cut_last_line(tmp_path) -> None:
    path = tmp_path / "o.jsonl"
    path.write_text('{"id": "a:0"}\n{"id": "a:1"}')  # whole last line, only its newline missing
    assert OutputFile(path).resume() == {"a:0", "a:1"}
    assert path.read_text() == '{"id": "a:0"}\n{"id": "a:1"}\n'
    path.write_text('{"id": "a:0"}\n{"id": "a:')  # cut off by a kill
    assert OutputFile(path).resume() == {"a:0"}
    assert path.read_text() == '{"id": "a:0"}\n'
    path.write_text('{"id": "a:0"}\nnot json\n{"id": "a:2"}\n')  # damage inside is not ours to drop
    with pytest.raises(ValueError, match="o.jsonl:2"):
        OutputFile(path).resume()
    assert not OutputFile(tmp_path / "new.jsonl").resume() and not (tmp_path / "new.jsonl").exists()


def test_resume_reads_lines_whose_text_holds_unicode_line_separators(tmp_path) -> None:
    # the model writes U+2028 / U+0085 / \x1c now and then; json.dumps(ensure_ascii=False) keeps them raw, and
    # str.splitlines() would cut such a record in two
    path = tmp_path / "o.jsonl"
    out = OutputFile(path)
    out.write({"id": "a:0", "text": "one\u2028two\x85three\x1cfour"})
    out.write({"id": "a:1", "text": "plain"})
    out.close()
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert OutputFile(path).resume() == {"a:0", "a:1"}


def test_command_errors_name_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("EYAS_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        data_main("--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o.jsonl"))
    with pytest.raises(ValueError, match="--endpoint"):
        data_main("--prompts", "x", "--api-model", "m", "--out", str(tmp_path / "o.jsonl"))


def test_device_option(model_dir, prompt_file, tmp_path) -> None:
    common = ("--prompts", str(prompt_file), "--model", str(model_dir), "--dtype", "float32",
              "--max-new-tokens", "4", "--batch-size", "3", "--limit", "2")
    with pytest.raises(ValueError, match="not a torch device"):
        data_main(*common, "--device", "gpu0", "--out", str(tmp_path / "a.jsonl"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device; use --device cpu"):
            data_main(*common, "--device", "cuda", "--out", str(tmp_path / "b.jsonl"))
    assert data_main(*common, "--device", "cpu", "--out", str(tmp_path / "c.jsonl")) == 0
    assert data_main(*common, "--out", str(tmp_path / "d.jsonl")) == 0  # auto
    if not torch.cuda.is_available():  # auto is the cpu here
        assert (tmp_path / "c.jsonl").read_text() == (tmp_path / "d.jsonl").read_text()


# ---- remote mode against a stub OpenAI server --------------------------------------------------------
class _Stub(BaseHTTPRequestHandler):
    requests: list[dict] = []

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": "stub-model", "object": "model", "created": 0, "owned_by": "test"},
                {"id": "other", "object": "model", "created": 0, "owned_by": "test"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.requests.append(req)
        last = req["messages"][-1]["content"]
        if req["model"] == "missing":
            self._send(404, {"error": {"message": "model 'missing' does not exist"}})
            return
        if "TOO LONG" in last:
            error = {"message": "context length exceeded", "type": "invalid_request_error"}
            self._send(400, {"error": error})
            return
        n_turn = sum(m["role"] == "user" for m in req["messages"])
        text = f"answer {n_turn} to {last}"
        self._send(200, {
            "id": "c", "object": "chat.completion", "created": 0, "model": req["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": len(req["messages"]), "completion_tokens": len(text.split()),
                      "total_tokens": 0},
        })


@pytest.fixture(scope="module")
def stub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_multi_turn_and_refusals(stub_server, tmp_path) -> None:
    _Stub.requests.clear()
    convs = [Conversation("r:0", "r", [[{"role": "system", "content": "sys"}, user("a")], [user("b")]]),
             Conversation("r:1", "r", [[user("TOO LONG")]])]
    convs += [Conversation(f"r:{i}", "r", [[user(f"q{i}")]]) for i in range(2, 9)]
    out = OutputFile(tmp_path / "remote.jsonl")
    gen = RemoteGenerator(RemoteConfig(endpoint=stub_server, concurrency=3, max_new_tokens=7))
    assert gen.model == "stub-model"  # the first id of GET /v1/models
    sink = Sink(out, gen.describe())
    gen.run(convs, sink)
    out.close()
    recs = {r["id"]: r for r in map(json.loads, out.path.read_text().splitlines())}
    assert set(recs) == {"r:0"} | {f"r:{i}" for i in range(2, 9)}
    assert [s[0] for s in sink.skipped] == ["r:1"] and "context length" in sink.skipped[0][1]
    assert recs["r:0"]["messages"] == [
        {"role": "system", "content": "sys"}, user("a"), {"role": "assistant", "content": "answer 1 to a"},
        user("b"), {"role": "assistant", "content": "answer 2 to b"},
    ]
    assert recs["r:0"]["usage"] == {"prompt_tokens": 2 + 4, "completion_tokens": 8}
    assert recs["r:0"]["finish_reasons"] == ["stop", "stop"]
    assert recs["r:0"]["generator"]["model"] == "stub-model"
    assert all(r["temperature"] == 0.0 and r["max_tokens"] == 7 for r in _Stub.requests)
    assert sink.generated_tokens == sum(r["usage"]["completion_tokens"] for r in recs.values())


def test_remote_command_and_unreachable_endpoint(stub_server, prompt_file, tmp_path, capsys) -> None:
    out = tmp_path / "o.jsonl"
    assert data_main("--prompts", str(prompt_file), "--endpoint", stub_server + "/v1", "--api-model", "other",
                     "--concurrency", "2", "--out", str(out)) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 7 and all(r["generator"]["model"] == "other" for r in recs)
    assert "data: 7 conversations" in capsys.readouterr().out
    one = [Conversation("x:0", "x", [[user("hi")]])]
    closed = "http://127.0.0.1:1/v1"  # nothing listens on port 1
    gen = RemoteGenerator(RemoteConfig(endpoint=closed, api_model="m", max_retries=0))
    with pytest.raises(ValueError, match="cannot reach"):
        gen.run(one, Sink(OutputFile(tmp_path / "n.jsonl"), {}))
    gen = RemoteGenerator(RemoteConfig(endpoint=stub_server, api_model="missing", max_retries=0))
    with pytest.raises(ValueError, match="HTTP 404.*--api-model 'missing'"):
        gen.run(one, Sink(OutputFile(tmp_path / "n.jsonl"), {}))


def test_base_url() -> None:
    assert base_url("http://h:8000") == "http://h:8000/v1"
    assert base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert base_url("http://h:8000/v1/chat/completions") == "http://h:8000/v1"
    assert base_url("https://h/openai/v1") == "https://h/openai/v1"
    with pytest.raises(ValueError, match="--endpoint"):
        base_url("h:8000")


def test_bf16_decode_cache_gives_the_fp32_cache_tokens(spec, tiny, monkeypatch) -> None:
    """A bf16 model's engine keeps a bf16 cache where the decode kernel reads one: the same values as the fp32
    cache, so the same tokens (prefill upcasts for torch's attention, decode converts exactly)."""
    from eyas.models.loading import native_from_hf_model

    model = native_from_hf_model(tiny.hf("llama"), torch.bfloat16)
    ps = prompts(spec)
    cfg = EngineConfig(batch_size=3, refill_at=1, max_new_tokens=20, prefill_chunk=7, slots=16)  # grows, refills

    def run() -> list[list[int]]:
        return [c.token_ids for c in RefillEngine(model, (), cfg).generate(ps)]

    compact = run()
    monkeypatch.setattr(type(model), "decode_kv_dtype", lambda self: torch.float32)
    assert run() == compact
    monkeypatch.undo()
    if model.path_kernel() is not None and model.path_kernel().decode_bf16():
        assert model.decode_kv_dtype() == torch.bfloat16
