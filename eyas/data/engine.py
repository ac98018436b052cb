"""Continuous-refill batched decoding on a native target: the engine behind ``eyas data``.

One KV cache of ``batch_size`` rows; rows 0 .. n-1 are live sequences, each at its own length:

- row b holds its tokens at slots 0 .. len_b - 1, RoPE position = slot (no padding inside a row);
- a decode step feeds every live row its last emitted token in one forward over [n, 1] tokens,
  ``start`` = the [n] row lengths (each row writes its own slot), mask ``slot <= len_b`` and a
  key length of max(len) + 1, so rows of any lengths share the step;
- a finished row (stop id or token budget) is handed to ``Jobs.done`` at once, and the last live
  row moves into its place (``KVCache.copy_row``), so the forward always runs on rows 0 .. n-1;
- freed rows are refilled from ``Jobs.next_job`` once ``refill_at`` of them are free (or none is
  live): the new prompts are prefilled together, right-padded, straight into their cache rows
  (pad slots hold junk that the decode mask hides and later steps overwrite).

Why: on a CPU with native bf16 matmuls a forward over many rows costs little more than over one,
so throughput grows with the rows kept busy; a static batch idles as its rows finish and pads
every row to the longest prompt. In float32 each row's tokens equal unbatched plain greedy
decoding of its prompt (``tests/data/test_generate.py``).

Every target forward goes through ``RefillEngine._forward`` (one place to adapt to the target API).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eyas.kv.static import KVCache
from eyas.models.base import TargetModel, causal_mask
from eyas.types import SamplingParams
from eyas.verify import logits_to_probs, sample


@dataclass
class EngineConfig:
    batch_size: int = 64  # rows decoded together (continuous refill keeps them full)
    max_new_tokens: int = 512  # per job unless the job says otherwise
    prefill_chunk: int = 256  # prompt tokens per row per prefill forward (bounds attention memory)
    prefill_rows: int = 16  # prompts prefilled in one forward
    # refill once this many rows are free (None: batch_size // 8, at least 1); a step with no live
    # row always refills
    refill_at: int | None = None
    slots: int = 512  # initial cache slots per row; the cache grows when a job needs more
    seed: int | None = None  # sampling: one torch.Generator for the whole run (None: fresh seed)

    def __post_init__(self) -> None:
        if self.refill_at is None:
            self.refill_at = max(1, self.batch_size // 8)
        for name in ("batch_size", "max_new_tokens", "prefill_chunk", "prefill_rows", "refill_at", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Job:
    key: object  # the caller's handle
    prompt: list[int]  # token ids, >= 1
    mode: int = 0  # index into the engine's sampling modes
    max_new_tokens: int | None = None  # None: the engine's max_new_tokens


@dataclass
class Completion:
    # generated ids, the stop token included when one ended the row
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


class Jobs(Protocol):
    """Where the engine takes work from and reports it to (a scheduler)."""

    def next_job(self) -> Job | None:
        """The next prompt to decode, or None when there is nothing now (``done`` may add more)."""

    def done(self, job: Job, completion: Completion) -> None:
        """A job finished; may queue follow-up jobs (next turn of a conversation)."""


@dataclass
class _Live:
    """Host-side state of the live rows 0 .. n-1 (row-parallel lists)."""

    jobs: list[Job] = field(default_factory=list)
    out: list[list[int]] = field(default_factory=list)  # tokens emitted so far
    budgets: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)  # tokens in the cache row (= next write slot)

    def __len__(self) -> int:
        return len(self.jobs)


class RefillEngine:
    """Plain (non-speculative) decoding of many prompts with continuous refill."""

    def __init__(self, model: TargetModel, stop_ids: Sequence[int], cfg: EngineConfig,
                 modes: Sequence[SamplingParams] = (SamplingParams(),)) -> None:
        if not model.row_starts:
            raise ValueError(f"{type(model).__name__} cannot decode rows of different lengths in one forward; "
                             f"eyas data needs the native backend")
        self.model, self.cfg, self.modes = model, cfg, tuple(modes)
        self.stop = frozenset(int(s) for s in stop_ids)
        self.generator = None
        if any(not m.greedy for m in self.modes):
            self.generator = torch.Generator(device=model.device)
            if cfg.seed is not None:
                self.generator.manual_seed(cfg.seed)
            else:
                self.generator.seed()  # a fresh nondeterministic seed for this generator only
        self.forwards = 0  # target forwards run (profiling)

    def budget(self, prompt_len: int, max_new_tokens: int | None = None) -> int:
        """New tokens a prompt of this length may get: max_new_tokens, or less near the context end."""
        cap = max_new_tokens if max_new_tokens is not None else self.cfg.max_new_tokens
        return min(cap, self.model.config.max_position_embeddings - prompt_len)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Decode every prompt (greedy or mode 0); completions in prompt order."""
        jobs = _ListJobs([Job(i, list(p)) for i, p in enumerate(prompts)])
        self.run(jobs)
        return [jobs.results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def run(self, jobs: Jobs) -> None:
        """Decode until ``jobs`` has nothing left and every row is done."""
        live = _Live()
        cache = self.model.new_cache(self.cfg.batch_size, self.cfg.slots)
        logits = None  # [n, V] float32: next-token logits of every live row
        while True:
            cache, logits = self._refill(live, jobs, cache, logits)
            if not live:
                return
            tokens = self._pick(logits, [j.mode for j in live.jobs])  # [n]
            finished = self._emit(live, tokens.tolist())
            for row in sorted(finished, reverse=True):  # the last live row fills each hole
                job, out = self._remove(live, cache, row)
                jobs.done(job, Completion(out, "stop" if out[-1] in self.stop else "length"))
            if live:  # feed every live row its last emitted token
                last = torch.tensor([o[-1] for o in live.out], dtype=torch.long, device=self.model.device)
                logits = self._decode(live, cache, last)

    # ---- steps ---------------------------------------------------------------------------------
    def _emit(self, live: _Live, tokens: list[int]) -> list[int]:
        """Append each row's token; returns the rows that just finished."""
        finished = []
        for b, tok in enumerate(tokens):
            live.out[b].append(tok)
            if tok in self.stop or len(live.out[b]) >= live.budgets[b]:
                finished.append(b)
        return finished

    def _remove(self, live: _Live, cache: KVCache, row: int) -> tuple[Job, list[int]]:
        """Drop live row ``row``; the last live row moves into its place (cache included)."""
        last = len(live) - 1
        gone = (live.jobs[row], live.out[row])
        if row != last:
            cache.copy_row(last, row, live.lens[last])
            for lst in (live.jobs, live.out, live.budgets, live.lens):
                lst[row] = lst[last]
        for lst in (live.jobs, live.out, live.budgets, live.lens):
            lst.pop()
        return gone

    def _decode(self, live: _Live, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """One step: tokens [n] (each row's last emitted token) -> next-token logits [n, V]."""
        dev = self.model.device
        n = len(live)
        lens = torch.tensor(live.lens, dtype=torch.long, device=dev)  # [n]
        kv_len = max(live.lens) + 1
        mask = torch.arange(kv_len, device=dev)[None] <= lens[:, None]  # [n, S]
        out = self._forward(tokens.to(dev)[:, None], lens[:, None], cache.rows(0, n), lens, mask[:, None], kv_len)
        for b in range(n):
            live.lens[b] += 1
        return out.logits[:, -1].float()

    def _refill(self, live: _Live, jobs: Jobs, cache: KVCache, logits):
        """Prefill new jobs into free rows when enough are free; returns (cache, logits)."""
        free = self.cfg.batch_size - len(live)
        if free < self.cfg.refill_at and live:
            return cache, logits
        new: list[Job] = []
        while len(new) < free:
            job = jobs.next_job()
            if job is None:
                break
            if not job.prompt or self.budget(len(job.prompt), job.max_new_tokens) < 1:
                raise ValueError(f"job {job.key!r}: every prompt needs >= 1 token and room for >= 1 new token "
                                 f"in the context")
            new.append(job)
        if not new:
            return cache, logits
        need = max(len(j.prompt) + self.budget(len(j.prompt), j.max_new_tokens) for j in new)
        cache = self._fit(cache, live, need)
        parts = [] if logits is None or not live else [logits]
        for s in range(0, len(new), self.cfg.prefill_rows):
            group = new[s : s + self.cfg.prefill_rows]
            n = len(live)
            parts.append(self._prefill([j.prompt for j in group], cache.rows(n, n + len(group))))
            for j in group:
                live.jobs.append(j)
                live.out.append([])
                live.budgets.append(self.budget(len(j.prompt), j.max_new_tokens))
                live.lens.append(len(j.prompt))
        return cache, torch.cat(parts)

    def _fit(self, cache: KVCache, live: _Live, need: int) -> KVCache:
        """The cache, grown (rows copied) when a job needs more than ``need`` slots."""
        if need <= cache.max_slots:
            return cache
        slots = min(max(need, 2 * cache.max_slots), self.model.config.max_position_embeddings)
        grown = self.model.new_cache(self.cfg.batch_size, slots)
        if live:
            top = max(live.lens)
            grown.k[:, :, :, :top] = cache.k[:, :, :, :top]
            grown.v[:, :, :, :top] = cache.v[:, :, :, :top]
        return grown

    def _prefill(self, prompts: list[list[int]], cache: KVCache) -> torch.Tensor:
        """Prompts right-padded into cache rows (slots 0 ..); returns each one's next-token logits [k, V]."""
        dev = self.model.device
        k, t = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(k, t, dtype=torch.long, device=dev)  # [k, T], pad id 0
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [k]
        real = torch.arange(t, device=dev)[None] < lens[:, None]  # [k, T] real key slots
        positions = torch.arange(t, device=dev)[None].expand(k, t)
        last = torch.empty(k, self.model.config.hidden_size, dtype=self.model.dtype, device=dev)  # [k, D]
        none = torch.zeros(0, dtype=torch.long, device=dev)  # no vocab projection over every position
        for s in range(0, t, self.cfg.prefill_chunk):
            e = min(t, s + self.cfg.prefill_chunk)
            # [k, e - s, e]: causal AND real key. A pad query still sees slot 0 (a real token): no NaN
            mask = causal_mask(e - s, s, device=dev)[None] & real[:, None, :e]
            out = self._forward(tokens[:, s:e], positions[:, s:e], cache, s, mask, e, logits_idx=none)
            ends = ((lens - 1 >= s) & (lens - 1 < e)).nonzero().flatten()  # rows whose last token is here
            last[ends] = out.hidden[ends, lens[ends] - 1 - s]
        return self.model.lm_head(last).float()

    def _pick(self, logits: torch.Tensor, modes: list[int]) -> torch.Tensor:
        """[n, V] -> [n] next tokens: argmax, or a seeded draw from each row's mode's distribution."""
        tokens = logits.argmax(-1)
        for m, params in enumerate(self.modes):
            rows = [b for b, x in enumerate(modes) if x == m]
            if rows and not params.greedy:
                idx = torch.tensor(rows, device=logits.device)
                tokens[idx] = sample(logits_to_probs(logits[idx], params), self.generator)
        return tokens

    def _forward(self, tokens, positions, cache, start, mask, kv_len, logits_idx=None):
        """The one call into the target (tokens [b, T], positions [b, T], mask [b, T, S])."""
        self.forwards += 1
        return self.model.forward(tokens, positions, cache, start, mask=mask, logits_idx=logits_idx, kv_len=kv_len)


class _ListJobs:
    """A fixed list of jobs; results by key."""

    def __init__(self, jobs: list[Job]) -> None:
        self.todo = list(reversed(jobs))
        self.results: dict[object, Completion] = {}

    def next_job(self) -> Job | None:
        return self.todo.pop() if self.todo else None

    def done(self, job: Job, completion: Completion) -> None:
        self.results[job.key] = completion
