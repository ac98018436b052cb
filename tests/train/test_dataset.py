"""Reading training conversations: both chat formats, and a clear error on unknown speakers."""

from __future__ import annotations

import json

import pytest

from eyas.train.dataset import read_conversations


def test_sharegpt_and_openai_records_read_alike(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "no answer"}]}),  # nothing to learn
        '{"id": "d", "messa',  # a line truncated by a kill
    ]) + "\n")
    convs = read_conversations([f])
    assert [c["id"] for c in convs] == ["a", "b"]
    assert convs[0]["messages"] == convs[1]["messages"]


def test_unknown_speaker_is_an_error_naming_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"conversations": [{"from": "robot", "value": "hi"}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: unknown ShareGPT speaker 'robot'"):
        read_conversations([f])
