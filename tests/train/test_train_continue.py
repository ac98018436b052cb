"""``eyas train --init-head`` (continue an exported EAGLE-3 head) and ``--time-budget`` (a schedule that ends on
time), on a small slice of the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.cli import main
from eyas.train.loop import EXPORT_S, TrainConfig, _budget_step, _seconds_for_steps, _set_lr

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
             "What is 2+2?", "Explain gravity briefly.", "List two fruits.", "Say hello in Spanish.",
             "What is water made of?", "Give a synonym for happy.", "Count to five."]


def _data(path: Path, answer: str) -> Path:
    recs = [{"id": f"t:{i}", "messages": [{"role": "user", "content": q},
                                          {"role": "assistant", "content": answer.format(q.lower())}]}
            for i, q in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _args(data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--max-steps", str(steps), "--draft-vocab", "256",
            "--batch-tokens", "256", "--max-len", "96", "--save-every", "100", "--eval-every", "1000",
            "--holdout", "1", "--eval-tokens", "8", "--warmup-steps", "1", "--target-dtype", "float32",
            "--mixed-precision", "no", *extra]


def test_init_head_keeps_the_exported_head_and_its_vocabulary(default_target, tmp_path):
    first = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    assert main(_args(first, tmp_path / "a", 2)) == 0
    head_a = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    # other data (another draft vocabulary if chosen afresh), learning rate 0: the export must be head a again
    other = _data(tmp_path / "b.jsonl", "Numbers 1 2 3 4 5 6 7 8 9 and {} spelled backwards")
    assert main(_args(other, tmp_path / "b", 1, "--init-head", str(tmp_path / "a" / "head"), "--lr", "0")) == 0
    head_b = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert head_a.keys() == head_b.keys()
    assert torch.equal(head_a["d2t"], head_b["d2t"]) and torch.equal(head_a["t2d"], head_b["t2d"])
    for k in head_a:  # fc unfolded by this run's input scale and folded again on export: the same function
        torch.testing.assert_close(head_b[k].float(), head_a[k].float(), rtol=1e-2, atol=1e-6, msg=k)
    # a fresh head on the other data picks its own vocabulary: the test above is not vacuous
    assert main(_args(other, tmp_path / "c", 1)) == 0
    assert not torch.equal(load_file(str(tmp_path / "c" / "head" / "model.safetensors"))["d2t"], head_a["d2t"])


def test_init_head_rejects_other_kinds(tmp_path, capsys):
    assert main(["train", "--data", "x.jsonl", "--out", str(tmp_path), "--kind", "medusa", "--init-head", "h"]) != 0
    assert "--init-head continues an EAGLE-3 head" in capsys.readouterr().err


def test_time_budget_ends_the_run_and_its_schedule(default_target, tmp_path):
    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    out = tmp_path / "run"
    assert main(_args(data, out, 500, "--time-budget", "0.001")) == 0  # spent after the first step
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 1 and summary["schedule_steps"] == 500
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1  # saved at the budget's end
    assert (out / "head" / "model.safetensors").exists()


def test_budget_step_follows_the_larger_of_steps_and_time():
    cfg = TrainConfig(data=[], out_dir="", warmup_steps=0, time_budget=100.0)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert _budget_step(100.0, total=1000, start=0, step=10, elapsed=50.0) == 500  # half the time: half the schedule
    _set_lr(cfg, opt, sched, 1000, 500)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)  # cosine at its midpoint
    assert _budget_step(100.0, total=1000, start=0, step=700, elapsed=50.0) == 700  # steps ahead of the clock
    assert _budget_step(100.0, total=1000, start=200, step=201, elapsed=100.0) == 1000  # a resumed run, spent
    _set_lr(cfg, opt, sched, 1000, 1000)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_wall_budget_leaves_the_steps_what_loading_and_the_export_do_not_use():
    cfg = TrainConfig(data=[], out_dir="", wall_budget=500.0)
    assert _seconds_for_steps(cfg, loading=100.0) == pytest.approx(400.0 - EXPORT_S)
    cfg.time_budget = 120.0  # the smaller of the two
    assert _seconds_for_steps(cfg, loading=100.0) == pytest.approx(120.0)
    assert _seconds_for_steps(TrainConfig(data=[], out_dir="", time_budget=50.0), loading=1e6) == 50.0  # no wall budget
    with pytest.raises(ValueError, match="leaves no time to train: loading took 480 s"):
        _seconds_for_steps(cfg, loading=480.0)


def test_wall_budget_must_be_positive(tmp_path, capsys):
    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    assert main(_args(data, tmp_path / "run", 5, "--wall-budget", "0")) != 0
    assert "--wall-budget must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_wall_budget_run_exports_the_head_without_a_final_eval(default_target, tmp_path, capsys):
    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    out = tmp_path / "run"
    assert main(_args(data, out, 2, "--wall-budget", "100000")) == 0  # the steps, not the budget, end this run
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["schedule_steps"] == 2 and summary["eval"] == {}
    assert (out / "head" / "model.safetensors").exists()
    said = capsys.readouterr().out
    assert "--wall-budget: " in said and "s for the steps (loading took" in said and "no final held-aside eval" in said
