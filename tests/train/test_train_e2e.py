"""The whole pipeline on a small slice of the embedded model: train -> checkpoint -> resume
(also after SIGKILL) -> export -> the exported head drafts losslessly through `eyas generate`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.cli import main

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
             "What is 2+2?", "Explain gravity briefly.", "List two fruits.", "Say hello in Spanish.",
             "What is water made of?", "Give a synonym for happy.", "Count to five."]


@pytest.fixture(scope="module")
def data(tmp_path_factory, default_target) -> Path:
    p = tmp_path_factory.mktemp("distill") / "d.jsonl"
    recs = [{"id": f"t:{i}", "messages": [{"role": "user", "content": q},
                                          {"role": "assistant", "content": f"A short answer to: {q.lower()}"}]}
            for i, q in enumerate(QUESTIONS)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def _args(data: Path, out: Path, steps: int, kind: str = "eagle3") -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--kind", kind, "--max-steps", str(steps),
            "--draft-vocab", "256", "--batch-tokens", "256", "--max-len", "96", "--save-every", "1",
            "--eval-every", "1000", "--holdout", "1", "--eval-tokens", "8", "--warmup-steps", "1",
            "--target-dtype", "float32", "--mixed-precision", "no"]


def _state(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "state.json").read_text())


def test_train_resume_and_export(data, tmp_path, capsys, monkeypatch, default_target):
    out = tmp_path / "run"
    assert main(_args(data, out, 2)) == 0
    assert _state(out)["step"] == 2
    assert main(_args(data, out, 3)) == 0  # a longer run picks up the checkpoint
    assert "resuming from" in capsys.readouterr().out
    assert _state(out)["step"] == 3
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval"]["tau"] >= 1.0
    assert (out / "train_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # tau against tokens
    head = out / "head"
    assert (head / "config.json").exists() and (head / "model.safetensors").exists()
    # its acceptance profile, from the held-aside conversation, keyed to the exported weights: the tree is sized
    # at load (eyas.autotree) as for the shipped head
    from eyas.autotree import load_profile

    profile = load_profile(head)
    assert profile is not None and len(profile.rank_accept) == 6 and profile.tree_tau is None
    assert all(0.0 <= sum(row) <= 1.0 + 1e-6 for row in profile.rank_accept)
    # the exported head drafts for the target it was trained on, losslessly
    prompt = QUESTIONS[0]
    common = ["--max-new-tokens", "24", "--dtype", "float32", "--json"]
    assert main(["generate", prompt, "--drafter", "none", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", prompt, "--drafter", str(head), *common]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    # and with it eyas sizes the head's tree at load (tests turn sizing off: on here, machine costs faked)
    from eyas import autotree
    from eyas.drafters.loading import DrafterSpec
    from eyas.tree.sizing import DraftCost

    monkeypatch.delenv("EYAS_AUTO_TREE", raising=False)
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    costs = {1: 0.04, 2: 0.041, 4: 0.043, 8: 0.05, 16: 0.07, 32: 0.1}
    monkeypatch.setattr(autotree, "measure_step_costs", lambda model, exact: costs)
    monkeypatch.setattr(autotree, "measure_draft_cost", lambda *a, **kw: DraftCost(0.004, 0.003, 0.0002))
    choice = autotree.size_tree_for(default_target, DrafterSpec(str(head)))
    assert choice is not None and choice.tau_source == "model"  # rank_accept alone: no replayed trees


def _poll_step(out: Path) -> int:
    try:
        return _state(out)["step"]
    except (OSError, ValueError):  # not written yet, or being renamed
        return 0


def test_sigkill_loses_at_most_one_checkpoint_interval(data, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas", *_args(data, out, 50)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and _poll_step(out) < 2:
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    killed_at = _state(out)["step"]
    assert 2 <= killed_at < 50
    assert main(_args(data, out, killed_at + 1)) == 0
    assert _state(out)["step"] == killed_at + 1


@pytest.mark.parametrize("kind", ["eagle1", "medusa"])
def test_other_kinds_train_export_and_draft_losslessly(data, tmp_path, capsys, kind):
    out = tmp_path / kind
    extra = ["--medusa-heads", "2"] if kind == "medusa" else []
    assert main(_args(data, out, 2, kind) + extra) == 0
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 2
    capsys.readouterr()  # drop the training log
    head = out / "head"
    assert (head / "config.json").exists()
    common = ["--max-new-tokens", "16", "--dtype", "float32", "--json"]
    assert main(["generate", QUESTIONS[1], "--drafter", "none", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", QUESTIONS[1], "--drafter", str(head), *common]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    cfg = json.loads((head / "config.json").read_text())
    if kind == "eagle1":  # issue 13 defect 3: vLLM's layout beside the reference one, with no fc bias
        from safetensors import safe_open

        vllm = out / "head_vllm"
        with safe_open(str(next(vllm.glob("*.safetensors"))), "pt") as f:
            assert not any(k.endswith("fc.bias") for k in f.keys())
        assert json.loads((vllm / "config.json").read_text()).get("bias", False) is False
    else:  # issue 13 defect 7: the embedded target is named as engines resolve it
        assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
