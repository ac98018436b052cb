"""Where a training step's time goes: a few steps of a run under torch.profiler (``eyas train --profile-steps N``).

A lent GPU trains for minutes, and the draws so far ran ~74 ms a step at 16,384 tokens (~137 k tok/s on an H200,
well below its bf16 peak for a 135M target and a one-layer head): whether that is the GPU's math, kernel
launches, or the host waiting on the device (boolean-mask indexing and ``float(tensor)`` synchronise) can only be
told from a profile taken there. ``StepProfiler`` records steps ``start .. start + n - 1`` (after the first
steps' allocator and cuBLAS warm-up), with the step's two halves labelled (``eyas.featurize``: the target's forward
for the batch's features; ``eyas.train_step``: the head's loss, backward and optimizer step), and writes
``profile.txt``: the wall time per profiled step, then torch's op table sorted by device time on a GPU (by CPU
time elsewhere). The profiled steps train as any other; only their time is longer (the profiler's overhead).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

LABELS = ("eyas.featurize", "eyas.train_step")
START = 10  # the first profiled step unless told (past the first steps' one-time set-up)


class StepProfiler:
    """Profiles steps ``start .. start + n - 1`` (0-based counts of this run's steps) into ``out / 'profile.txt'``."""

    def __init__(self, n: int, out: Path, start: int = START, log=print, rows: int = 40) -> None:
        if n < 0 or start < 0:
            raise ValueError(f"--profile-steps must be >= 0 (got {n}); the first profiled step >= 0 (got {start})")
        self.n, self.start, self.out, self.log, self.rows = n, start, Path(out), log, rows
        self.gpu = torch.cuda.is_available()
        self._prof: profile | None = None
        self._seen = 0  # steps of this run so far
        self._t0 = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one whole training step (features, loss, backward, optimizer)."""
        i = self._seen
        self._seen += 1
        if not self.n or not self.start <= i < self.start + self.n:
            yield
            return
        if i == self.start:
            self._sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        try:
            yield
        finally:
            if i == self.start + self.n - 1 and self._prof is not None:
                self._sync()
                wall = (time.perf_counter() - self._t0) / self.n
                self._prof.__exit__(None, None, None)
                self._write(wall)
                self._prof = None

    @staticmethod
    def part(name: str):
        """A labelled part of a step (one of ``LABELS``); a no-op outside the profiled steps."""
        return record_function(name)

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def _write(self, wall: float) -> None:
        sort = "self_cuda_time_total" if self.gpu else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=sort, row_limit=self.rows, max_name_column_width=60)
        device = torch.cuda.get_device_name() if self.gpu else "cpu"
        head = (f"steps {self.start}..{self.start + self.n - 1} of this run on {device}: "
                f"{wall * 1e3:.1f} ms a step (wall, device synchronised at both ends, profiler included)\n"
                f"labels: {', '.join(LABELS)} (a step's features, then its loss, backward and optimizer step)\n")
        path = self.out / "profile.txt"
        path.write_text(head + table + "\n")
        self.log(f"profile of {self.n} steps: {wall * 1e3:.1f} ms a step -> {path}")
