"""Reading training conversations: both chat formats, clear errors naming file and line, cut last lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.train.dataset import read_conversations

REPO = Path(__file__).resolve().parents[2]


def test_sharegpt_and_openai_records_read_alike(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "no answer"}]}),  # nothing to learn
    ]) + "\n")
    convs = read_conversations([f])
    assert [c["id"] for c in convs] == ["a", "b"]
    assert convs[0]["messages"] == convs[1]["messages"]


def test_unicode_line_separators_inside_a_record_do_not_split_it(tmp_path):
    f = tmp_path / "d.jsonl"
    msgs = [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\x85d\u2029e"}]
    f.write_text(json.dumps({"id": "a", "messages": msgs}, ensure_ascii=False) + "\n", encoding="utf-8")
    convs = read_conversations([f])
    assert [c["messages"] for c in convs] == [msgs]


def test_a_cut_last_line_is_skipped_with_a_warning_naming_it(tmp_path):
    f = tmp_path / "d.jsonl"
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"}]})
    f.write_text(good + "\n" + '{"id": "b", "messa')  # the last write was cut off by a kill
    logged = []
    assert [c["id"] for c in read_conversations([f], log=logged.append)] == ["a"]
    assert len(logged) == 1 and "d.jsonl:2" in logged[0] and "skipped" in logged[0]
    f.write_text('{"id": "b", "messa\n' + good + "\n")  # damage before the last line: an error
    with pytest.raises(ValueError, match=r"d\.jsonl:1: not valid JSON"):
        read_conversations([f], log=logged.append)


@pytest.mark.parametrize("record, why", [
    ({"messages": "notalist"}, r"'messages' must be a list of message objects"),
    ({"messages": ["hi"]}, r"'messages' must be a list of message objects"),
    ({"messages": [{"role": "user"}]}, r"a message in 'messages' has no 'content' field"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, r"message content must be a string"),
    ({"conversations": {"from": "human"}}, r"'conversations' must be a list"),
    (["not", "an", "object"], r"expected a JSON object"),
])
def test_malformed_record_is_an_error_naming_file_and_line(tmp_path, record, why):
    f = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: " + why):
        read_conversations([f])


def test_eyas_train_on_a_malformed_record_ends_with_one_error_line(tmp_path):
    """The command line: one `eyas: error:` line naming file and line, exit 2, no traceback."""
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": "notalist"}) + "\n")
    # the data is read before the target loads: no model is needed to see the error
    run = subprocess.run([sys.executable, "-m", "eyas", "train", "--data", str(f), "--out", str(tmp_path / "o"),
                          "--model", str(tmp_path / "no-such-model")],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert re.search(r"^eyas: error: .*bad\.jsonl:1: 'messages' must be a list", run.stderr, re.M), run.stderr


def test_unknown_speaker_is_an_error_naming_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"conversations": [{"from": "robot", "value": "hi"}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: unknown ShareGPT speaker 'robot'"):
        read_conversations([f])


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_packed_files_read_like_the_plain_one(tmp_path, suffix):
    import gzip
    import lzma

    text = "\n".join(json.dumps({"id": f"t:{i}", "messages": [{"role": "user", "content": f"q{i}\u2028"},
                                                             {"role": "assistant", "content": f"a{i}"}]})
                     for i in range(3)) + "\n"
    plain = tmp_path / "d.jsonl"
    plain.write_text(text, encoding="utf-8")
    packed = tmp_path / f"d.jsonl{suffix}"
    with (lzma.open if suffix == ".xz" else gzip.open)(packed, "wt", encoding="utf-8") as f:
        f.write(text)
    assert read_conversations([packed]) == read_conversations([plain])
    bad = tmp_path / f"bad.jsonl{suffix}"
    bad.write_bytes(b"not compressed")
    with pytest.raises(ValueError, match=f"bad.jsonl{re.escape(suffix)}: not a readable"):
        read_conversations([bad])


def test_the_shipped_packed_data_reads():
    convs = read_conversations([REPO / "data/heldout/smollm2-135m-instruct-magpie-seed13.jsonl.xz"])
    assert len(convs) > 100 and all(c["id"].startswith("magpie:") for c in convs)
