"""Training checkpoints: the head as safetensors, optimizer and schedule through ``torch.load(weights_only=True)``.

Written to ``OUT/checkpoint.tmp`` and renamed into place (the previous one kept as ``checkpoint.old`` until the
rename), so a SIGKILL at any point leaves one whole checkpoint to resume from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn


def save_checkpoint(out: Path, head: nn.Module, opt, sched, state: dict) -> None:
    from safetensors.torch import save_file

    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(tmp / "head.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    old = out / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out: Path, head: nn.Module, opt, sched, log=print) -> dict | None:
    """Restore head, optimizer and schedule; the state dict (step, epoch, batch, tokens, seconds) or None.

    A slim checkpoint (head.safetensors + state.json, no optimizer.pt: the form small enough to carry
    between machines in git) resumes with fresh AdamW moments and the schedule set to its step.
    """
    from safetensors.torch import load_file

    ck = out / "checkpoint"
    if not (ck / "state.json").exists():
        ck = out / "checkpoint.old"  # killed between the two renames
        if not (ck / "state.json").exists():
            return None
    head.load_state_dict(load_file(str(ck / "head.safetensors")))
    state = json.loads((ck / "state.json").read_text())
    if (ck / "optimizer.pt").exists():
        opt_state = torch.load(ck / "optimizer.pt", map_location="cpu", weights_only=True)
        opt.load_state_dict(opt_state["optimizer"])
        sched.load_state_dict(opt_state["scheduler"])
    else:
        log(f"{ck} has no optimizer.pt: resuming with fresh AdamW moments, learning-rate schedule at step "
            f"{state['step']}")
        sched.last_epoch = state["step"]
        for group, base, f in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * f(state["step"])
    return state


def resume(out: Path, head: nn.Module, opt, sched, log) -> dict:
    """The run's state (step, epoch, batch, tokens, seconds): the checkpoint's, restored into head, optimizer and
    schedule, or a fresh one.
    """
    fresh = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0}
    state = load_checkpoint(out, head, opt, sched, log) or fresh
    if state["step"]:
        where = f"step {state['step']} (epoch {state['epoch']}, batch {state['batch']})"
        log(f"resuming from {out / 'checkpoint'} at {where}")
    return state
