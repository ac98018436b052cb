"""Prompt sources: every supported format, ids, the Alpaca eval-prompt exclusion, spec parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.data.sources import (
    ALPACA_EVAL_OVERLAP,
    ALPACA_EXCLUDED,
    TRAIN_SOURCES,
    read_sources,
    split_turns,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A miniature train directory in the layout of shared/data/train."""
    d = tmp_path / "train"
    alpaca = [{"instruction": f"instr {i}", "input": "", "output": "x"} for i in range(4000)]
    alpaca[1]["input"] = "the input"
    alpaca[2]["input"] = "   "  # whitespace-only input counts as empty
    (d / "alpaca").mkdir(parents=True)
    (d / TRAIN_SOURCES["alpaca"]).write_text(json.dumps(alpaca, indent=4))
    _jsonl(d / TRAIN_SOURCES["gsm8k"], [{"question": f"q{i}", "answer": "#### 1"} for i in range(3)])
    (d / "code_alpaca").mkdir()
    (d / TRAIN_SOURCES["code_alpaca"]).write_text(json.dumps(
        [{"instruction": "code it", "input": "x = 1", "output": "y"}, {"instruction": "sort", "input": ""}]))
    _jsonl(d / TRAIN_SOURCES["mt_bench_101"], [
        {"task": "GR", "id": 1, "history": [{"user": "u1", "bot": "b1"}, {"user": "u2", "bot": "b2"}]},
    ])
    return d


def test_train_sources_parse(data_dir: Path) -> None:
    convs = {c.id: c for c in read_sources(["all"], data_dir)}
    assert convs["alpaca:0"].turns == [[_user("instr 0")]]
    assert convs["alpaca:1"].turns == [[_user("instr 1\n\nthe input")]]
    assert convs["alpaca:2"].turns == [[_user("instr 2")]]
    assert convs["gsm8k:2"].turns == [[_user("q2")]] and convs["gsm8k:2"].source == "gsm8k"
    assert convs["code_alpaca:0"].turns == [[_user("code it\n\nx = 1")]]
    assert convs["code_alpaca:1"].turns == [[_user("sort")]]
    # multi-turn: the bot answers are dropped, one turn per user message
    assert convs["mt_bench_101:0"].turns == [[_user("u1")], [_user("u2")]]
    assert len(convs) == 4000 - sum(i < 4000 for i in ALPACA_EXCLUDED) + 3 + 2 + 1


def test_alpaca_eval_indices_excluded(data_dir: Path) -> None:
    ids = {c.id for c in read_sources(["alpaca"], data_dir)}
    assert len(ALPACA_EVAL_OVERLAP) == 80 and 3964 in ALPACA_EXCLUDED
    for i in ALPACA_EXCLUDED:
        assert f"alpaca:{i}" not in ids
    assert "alpaca:596" in ids and "alpaca:598" in ids  # neighbours of the first excluded index stay


def test_specs_comma_repeat_limit_and_shuffle(data_dir: Path) -> None:
    convs = read_sources(["gsm8k,code_alpaca", "mt_bench_101"], data_dir, limit=2)
    assert [c.id for c in convs] == ["gsm8k:0", "gsm8k:1", "code_alpaca:0", "code_alpaca:1", "mt_bench_101:0"]
    a = [c.id for c in read_sources(["alpaca"], data_dir, limit=5, shuffle_seed=7)]
    b = [c.id for c in read_sources(["alpaca"], data_dir, limit=5, shuffle_seed=7)]
    c = [c.id for c in read_sources(["alpaca"], data_dir, limit=5, shuffle_seed=8)]
    assert a == b and a != c and a != [f"alpaca:{i}" for i in range(5)]


def test_sharegpt_openai_and_turns_files(tmp_path: Path) -> None:
    share = _jsonl(tmp_path / "share.jsonl", [{"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "more"},
        {"from": "gpt", "value": "x"},
    ]}])
    oai = tmp_path / "oai.json"  # a JSON array works as well as jsonl
    answer = {"role": "assistant", "content": "b"}
    oai.write_text(json.dumps([{"messages": [_user("a"), answer, _user("c")]}]))
    questions = _jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "turns": ["t1", "t2"]}])
    convs = read_sources([f"{share},{oai}", str(questions)], None)
    assert [c.id for c in convs] == ["share:0", "oai:0", "q:0"]
    assert convs[0].turns == [[{"role": "system", "content": "be brief"}, _user("hi")], [_user("more")]]
    assert convs[1].turns == [[_user("a")], [_user("c")]]
    assert convs[2].turns == [[_user("t1")], [_user("t2")]]


def test_split_turns_edge_cases() -> None:
    sys_msg = {"role": "system", "content": "s"}
    assistant = {"role": "assistant", "content": "a"}
    # consecutive user messages share one answer; a trailing system note has nothing to answer
    assert split_turns([_user("x"), _user("y"), assistant, sys_msg]) == [[_user("x"), _user("y")]]
    assert split_turns([assistant, _user("x")]) == [[_user("x")]]
    assert split_turns([sys_msg, assistant]) == []


def test_bad_inputs_name_the_problem(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        read_sources(["all"], tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a source name"):
        read_sources([str(tmp_path / "missing.jsonl")], data_dir)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "alien", "value": "x"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl: record 0 .*alien"):
        read_sources([str(bad)], None)
    unknown = _jsonl(tmp_path / "unknown.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="record 0"):
        read_sources([str(unknown)], None)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["a"]}\n{"turns": \n')
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        read_sources([str(broken)], None)
    twin = _jsonl(tmp_path / "sub" / "gsm8k.jsonl", [{"turns": ["a"]}])
    with pytest.raises(ValueError, match="both named 'gsm8k'"):
        read_sources(["gsm8k", str(twin)], data_dir)
    with pytest.raises(ValueError, match="--limit"):
        read_sources(["gsm8k"], data_dir, limit=0)


# ---- the real files (skipped when shared/data is not beside the repository) -------------------
@pytest.mark.skipif(not (SHARED_DATA / "train").is_dir(), reason="shared/data not beside the repository")
def test_real_alpaca_eval_prompts_are_absent() -> None:
    def norm(s: str) -> str:
        return " ".join(s.split()).lower()

    eval_prompts = {norm(json.loads(line)["turns"][0])
                    for line in (SHARED_DATA / "alpaca" / "question.jsonl").read_text().splitlines()}
    records = json.loads((SHARED_DATA / "train" / TRAIN_SOURCES["alpaca"]).read_text())
    # the README's list is exactly the records whose instruction is an eval prompt
    overlap = {i for i, r in enumerate(records) if norm(r["instruction"]) in eval_prompts}
    assert overlap == set(ALPACA_EVAL_OVERLAP)
    convs = read_sources(["alpaca"], SHARED_DATA / "train")
    assert len(convs) == len(records) - len(ALPACA_EXCLUDED)
    kept = {c.id for c in convs}
    assert not any(f"alpaca:{i}" in kept for i in ALPACA_EXCLUDED)
    mt_bench_99 = norm("Prove the Pythagorean theorem.")
    assert all(norm(c.turns[0][-1]["content"]) not in eval_prompts | {mt_bench_99} for c in convs)
