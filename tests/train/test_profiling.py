"""``eyas train --profile-steps N``: a window of steps under torch.profiler, written to OUT/profile.txt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.cli import main
from eyas.train.profiling import LABELS, StepProfiler


def _calls(table: str, label: str) -> int:
    """The '# of Calls' column (the table's last) of the row named ``label``."""
    rows = [line.split() for line in table.splitlines() if line.strip().startswith(label + " ")]
    assert len(rows) == 1, table
    return int(rows[0][-1])


def _steps(prof: StepProfiler, n: int) -> list[bool]:
    """Run n fake steps; whether profile.txt existed after each."""
    seen = []
    w = torch.randn(8, 8)
    for _ in range(n):
        with prof.step():
            with prof.part(LABELS[0]):
                x = torch.randn(4, 8)
            with prof.part(LABELS[1]):
                (x @ w).relu().sum()
        seen.append((prof.out / "profile.txt").exists())
    return seen


def test_profiles_exactly_the_window(tmp_path):
    logs = []
    prof = StepProfiler(3, tmp_path, start=2, log=logs.append)
    assert _steps(prof, 7) == [False, False, False, False, True, True, True]  # written when step 4 ends
    text = (tmp_path / "profile.txt").read_text()
    assert text.startswith("steps 2..4 of this run on cpu: ") and " ms a step" in text
    for label in LABELS:  # three steps' parts, not the steps before or after the window
        assert _calls(text, label) == 3
    assert len(logs) == 1 and "profile of 3 steps" in logs[0]


def test_zero_steps_profiles_nothing(tmp_path):
    assert _steps(StepProfiler(0, tmp_path, start=0), 3) == [False] * 3


def test_bad_counts_are_named():
    with pytest.raises(ValueError, match="--profile-steps must be >= 0"):
        StepProfiler(-1, Path("."))


@pytest.mark.slow
def test_train_writes_the_profile(default_target, tmp_path):
    data = tmp_path / "d.jsonl"
    qs = ["What is 2+2?", "Name three colors.", "Say hello in Spanish.", "List two fruits."]
    data.write_text("".join(json.dumps({"id": f"t:{i}", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": f"A short answer to: {q}"}]}) + "\n"
        for i, q in enumerate(qs)))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--max-steps", "3", "--draft-vocab", "256",
                 "--batch-tokens", "256", "--max-len", "96", "--save-every", "100", "--eval-every", "1000",
                 "--holdout", "0", "--warmup-steps", "1", "--target-dtype", "float32", "--mixed-precision", "no",
                 "--profile-steps", "2", "--profile-start", "1"]) == 0  # not the 10th: 3 steps
    text = (out / "profile.txt").read_text()
    assert text.startswith("steps 1..2 of this run on cpu: ")
    for label in LABELS:
        assert _calls(text, label) == 2
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3  # the profiled steps trained


def test_cli_rejects_negative_profile_steps(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "o"), "--profile-steps", "-2"]) != 0
    assert "eyas: error: --profile-steps must be >= 0 (0 = no profile), got -2" in capsys.readouterr().err


def test_cli_passes_the_window_and_rejects_a_negative_start(monkeypatch):
    import eyas.train.command as command
    from eyas.cli import build_parser

    seen = []
    monkeypatch.setattr(command, "train", seen.append)
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--profile-steps", "5",
                                   "--profile-start", "1000"])
    assert a.func(a) == 0 and (seen[0].profile_steps, seen[0].profile_start) == (5, 1000)
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--profile-steps", "5"])
    assert a.func(a) == 0 and seen[1].profile_start == 10  # the default window: steps 10..14
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--profile-start", "-1"])
    with pytest.raises(ValueError, match="--profile-start"):
        a.func(a)
