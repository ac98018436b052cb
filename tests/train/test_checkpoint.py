"""Checkpoints: the full form restores optimizer moments; the slim form (no optimizer.pt) resumes the schedule."""

from __future__ import annotations

import torch
from torch import nn

from eyas.train.checkpoint import load_checkpoint, save_checkpoint
from eyas.train.loop import TrainConfig, _lr_lambda


def _setup(total: int = 100):
    torch.manual_seed(0)
    head = nn.Linear(4, 3)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    cfg = TrainConfig(data="x", out_dir="y", warmup_steps=5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total))
    return head, opt, sched, cfg


def _train(head, opt, sched, steps: int) -> None:
    for _ in range(steps):
        head(torch.randn(2, 4)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_full_checkpoint_restores_moments_and_schedule(tmp_path):
    head, opt, sched, _ = _setup()
    _train(head, opt, sched, 12)
    save_checkpoint(tmp_path, head, opt, sched, {"step": 12, "epoch": 0, "batch": 12, "tokens": 1, "seconds": 1.0})
    h2, o2, s2, _ = _setup()
    state = load_checkpoint(tmp_path, h2, o2, s2, log=lambda m: None)
    assert state["step"] == 12
    assert torch.equal(h2.weight, head.weight)
    assert o2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(o2.state[o2.param_groups[0]["params"][0]]["exp_avg"],
                       opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])


def test_slim_checkpoint_resumes_schedule_with_fresh_moments(tmp_path):
    head, opt, sched, cfg = _setup()
    _train(head, opt, sched, 30)
    save_checkpoint(tmp_path, head, opt, sched, {"step": 30, "epoch": 0, "batch": 30, "tokens": 1, "seconds": 1.0})
    (tmp_path / "checkpoint" / "optimizer.pt").unlink()
    # a longer run (new total) picks the slim checkpoint up where it stopped, on its own schedule
    h2, o2, s2, _ = _setup(total=400)
    logs = []
    state = load_checkpoint(tmp_path, h2, o2, s2, log=logs.append)
    assert state["step"] == 30 and torch.equal(h2.weight, head.weight)
    assert "no optimizer.pt" in logs[0]
    expected = 1e-3 * _lr_lambda(cfg, 400)(30)
    assert abs(o2.param_groups[0]["lr"] - expected) < 1e-12
    assert not o2.state  # fresh moments
    _train(h2, o2, s2, 1)
    assert abs(o2.param_groups[0]["lr"] - 1e-3 * _lr_lambda(cfg, 400)(31)) < 1e-12
