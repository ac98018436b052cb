"""Continuous-refill batched decoding on a native target: the engine behind ``eyas data``.

One KV cache of ``batch_size`` rows; rows 0 .. n-1 are live sequences, each at its own length:

- row b holds its tokens at slots 0 .. len_b - 1, RoPE position = slot (no padding inside a row);
- a decode step feeds every live row its last emitted token in one forward over [n, 1] tokens,
  ``start`` = the [n] row lengths (each row writes its own slot), mask ``slot <= len_b`` and a
  key length of max(len) + 1, so rows of any lengths share the step (on a CPU the compiled kernel of
  eyas.kernels reads each row only up to its own length, ``ForwardMeta.row_lengths``: +11 % tok/s on
  MT-Bench-101 in the first two minutes, more as histories grow apart);
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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eyas.kv.static import KVCache
from eyas.models.base import ForwardMeta, TargetModel
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
    # most slots per row (caps memory: rows x slots x ~46 KB for SmolLM2's fp32 cache); a job gets at
    # most max_slots - prompt tokens of budget, and one with no room left is refused like a too-long prompt
    max_slots: int = 2048
    seed: int | None = None  # sampling: one torch.Generator for the whole run (None: fresh seed)

    def __post_init__(self) -> None:
        if self.refill_at is None:
            self.refill_at = max(1, self.batch_size // 8)
        self.slots = min(self.slots, self.max_slots)
        for name in ("batch_size", "max_new_tokens", "prefill_chunk", "prefill_rows", "refill_at", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Job:
    key: object  # the caller's handle
    prompt: list[int]  # token ids, >= 1
    mode: int = 0  # index into the engine's sampling modes
    max_new_tokens: int | None = None  # None: the engine's max_new_tokens
    # the same prompt recurs (Magpie's user prefix): its keys/values are kept after the first prefill
    # and copied into later rows, which then feed only its last token
    shared: bool = False


@dataclass
class Completion:
    # generated ids, the stop token included when one ended the row
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


class Jobs(Protocol):
    """Where the engine takes work from and reports it to (a scheduler)."""

    def next_job(self) -> Job | None:
        """The next prompt to decode, or None when there is nothing now (``done`` may add more)."""

    def done(self, job: Job, completion: Completion) -> Job | None:
        """A job finished; may return a follow-up job (the next turn of its conversation).

        The finished row's keys/values over the prompt's common prefix with the row's tokens are
        reused and only the rest of the prompt is prefilled.
        """


@dataclass
class _Stash:
    """A finished row's keys/values, kept for a follow-up job whose prompt starts with that row's tokens."""

    # [Lyr, Hk, C, Dh] each: the first C slots of the row
    k: torch.Tensor
    v: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.k.shape[2])


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
        self.prefilled = 0  # prompt tokens prefilled (a reused row's tokens are not)

    def budget(self, prompt_len: int, max_new_tokens: int | None = None) -> int:
        """New tokens a prompt of this length may get: max_new_tokens, or less near the context end / max_slots."""
        cap = max_new_tokens if max_new_tokens is not None else self.cfg.max_new_tokens
        return min(cap, self.model.config.max_position_embeddings - prompt_len, self.cfg.max_slots - prompt_len)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Decode every prompt (greedy or mode 0); completions in prompt order."""
        jobs = _ListJobs([Job(i, list(p)) for i, p in enumerate(prompts)])
        self.run(jobs)
        return [jobs.results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def run(self, jobs: Jobs) -> None:
        """Decode until ``jobs`` has nothing left and every row is done."""
        live = _Live()
        cache = self.model.new_cache(self.cfg.batch_size, self.cfg.slots, self._kv_dtype())
        logits = None  # [n, V] float32: next-token logits of every live row
        pending: deque[tuple[Job, _Stash | None]] = deque()  # follow-up jobs first, before new ones
        self._shared: dict[tuple[int, ...], _Stash] = {}  # shared prompts' keys/values (all but the last token)
        while True:
            cache, logits = self._refill(live, jobs, pending, cache, logits)
            if not live:
                return
            tokens = self._pick(logits, [j.mode for j in live.jobs])  # [n]
            finished = self._emit(live, tokens.tolist())
            for row in sorted(finished, reverse=True):  # the last live row fills each hole
                job, out = live.jobs[row], live.out[row]
                follow = jobs.done(job, Completion(out, "stop" if out[-1] in self.stop else "length"))
                if follow is not None:
                    # the row holds prompt + out[:-1]: the last emitted token was never fed
                    pending.append((follow, _stash(cache, row, job.prompt + out[:-1], follow.prompt)))
                self._remove(live, cache, row)
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

    def _remove(self, live: _Live, cache: KVCache, row: int) -> None:
        """Drop live row ``row``; the last live row moves into its place (cache included)."""
        last = len(live) - 1
        if row != last:
            cache.copy_row(last, row, live.lens[last])
            for lst in (live.jobs, live.out, live.budgets, live.lens):
                lst[row] = lst[last]
        for lst in (live.jobs, live.out, live.budgets, live.lens):
            lst.pop()

    def _decode(self, live: _Live, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """One step: tokens [n] (each row's last emitted token) -> next-token logits [n, V]."""
        dev = self.model.device
        n = len(live)
        lens = torch.tensor(live.lens, dtype=torch.long, device=dev)  # [n]
        kv_len = max(live.lens) + 1
        mask = torch.arange(kv_len, device=dev)[None] <= lens[:, None]  # [n, S]
        out = self._forward(tokens.to(dev)[:, None], lens[:, None], cache.rows(0, n), lens, mask[:, None], kv_len,
                            row_lengths=lens + 1)
        for b in range(n):
            live.lens[b] += 1
        return out.logits[:, -1].float()

    def _refill(self, live: _Live, jobs: Jobs, pending: deque, cache: KVCache, logits):
        """Prefill follow-ups and new jobs into free rows when enough are free; returns (cache, logits)."""
        free = self.cfg.batch_size - len(live)
        if free < self.cfg.refill_at and live:
            return cache, logits
        new: list[tuple[Job, _Stash | None]] = []
        while len(new) < free:
            item = pending.popleft() if pending else (jobs.next_job(), None)
            job = item[0]
            if job is None:
                break
            if item[1] is None and job.shared:
                item = (job, self._shared.get(tuple(job.prompt)))
            if not job.prompt or self.budget(len(job.prompt), job.max_new_tokens) < 1:
                raise ValueError(f"job {job.key!r}: every prompt needs >= 1 token and room for >= 1 new token "
                                 f"in the context")
            new.append(item)
        if not new:
            return cache, logits
        need = max(len(j.prompt) + self.budget(len(j.prompt), j.max_new_tokens) for j, _ in new)
        cache = self._fit(cache, live, need)
        parts = [] if logits is None or not live else [logits]
        # continuations (a stash) and fresh prompts prefill in separate groups: a group's rows are
        # padded to its longest feed, and a continuation's feed is short
        for group in _groups([x for x in new if x[1] is not None], self.cfg.prefill_rows, cache.max_slots) + \
                _groups([x for x in new if x[1] is None], self.cfg.prefill_rows, cache.max_slots):
            n = len(live)
            rows = cache.rows(n, n + len(group))
            for i, (_, st) in enumerate(group):
                if st is not None:
                    rows.k[:, i, :, : st.tokens] = st.k
                    rows.v[:, i, :, : st.tokens] = st.v
            held = [st.tokens if st is not None else 0 for _, st in group]
            parts.append(self._prefill([j.prompt for j, _ in group], held, rows))
            for i, (j, _) in enumerate(group):
                if j.shared and len(j.prompt) > 1 and tuple(j.prompt) not in self._shared:
                    c = len(j.prompt) - 1
                    self._shared[tuple(j.prompt)] = _Stash(rows.k[:, i, :, :c].clone(), rows.v[:, i, :, :c].clone())
            for j, _ in group:
                live.jobs.append(j)
                live.out.append([])
                live.budgets.append(self.budget(len(j.prompt), j.max_new_tokens))
                live.lens.append(len(j.prompt))
        return cache, torch.cat(parts)

    def _fit(self, cache: KVCache, live: _Live, need: int) -> KVCache:
        """The cache, grown (rows copied) when a job needs more than ``need`` slots."""
        if need <= cache.max_slots:
            return cache
        slots = min(max(need, 2 * cache.max_slots), self.model.config.max_position_embeddings, self.cfg.max_slots)
        grown = self.model.new_cache(self.cfg.batch_size, slots, self._kv_dtype())
        if live:
            top = max(live.lens)
            grown.k[:, :, :, :top] = cache.k[:, :, :, :top]
            grown.v[:, :, :, :top] = cache.v[:, :, :, :top]
        return grown

    def _kv_dtype(self) -> torch.dtype | None:
        """bf16 where the decode kernel reads it (half the bytes per step, the same values), else the default."""
        return self.model.decode_kv_dtype() if hasattr(self.model, "decode_kv_dtype") else None

    def _prefill(self, prompts: list[list[int]], held: list[int], cache: KVCache) -> torch.Tensor:
        """Prompts into cache rows whose first ``held[b]`` slots already hold prompt b's first tokens.

        The rest of each prompt (its feed) is right-padded to T and written at slots held_b ..;
        returns each prompt's next-token logits [k, V].
        """
        dev = self.model.device
        k = len(prompts)
        feeds = [p[h:] for p, h in zip(prompts, held, strict=True)]
        t = max(len(f) for f in feeds)
        self.prefilled += sum(len(f) for f in feeds)
        tokens = torch.zeros(k, t, dtype=torch.long, device=dev)  # [k, T], pad id 0
        for b, f in enumerate(feeds):
            tokens[b, : len(f)] = torch.as_tensor(f, dtype=torch.long)
        lens = torch.tensor([len(f) for f in feeds], device=dev)  # [k] feed lengths
        base = torch.tensor(held, device=dev)  # [k]
        positions = base[:, None] + torch.arange(t, device=dev)[None]  # [k, T] (pad slots: junk, masked later)
        last = torch.empty(k, self.model.config.hidden_size, dtype=self.model.dtype, device=dev)  # [k, D]
        none = torch.zeros(0, dtype=torch.long, device=dev)  # no vocab projection over every position
        for s in range(0, t, self.cfg.prefill_chunk):
            e = min(t, s + self.cfg.prefill_chunk)
            kv_len = max(held) + e
            slots = torch.arange(kv_len, device=dev)[None, None]  # [1, 1, S]
            query = (base + s)[:, None, None] + torch.arange(e - s, device=dev)[None, :, None]  # [k, e - s, 1]
            # [k, e - s, S]: causal AND a real key; a pad query still sees the row's real tokens: no NaN
            mask = (slots <= query) & (slots < (base + lens)[:, None, None])
            start = s if not any(held) else base + s  # one offset for fresh rows, per-row otherwise
            out = self._forward(tokens[:, s:e], positions[:, s:e], cache, start, mask, kv_len, logits_idx=none)
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

    def _forward(self, tokens, positions, cache, start, mask, kv_len, logits_idx=None, row_lengths=None):
        """The one call into the target (tokens [b, T], positions [b, T], mask [b, T, S])."""
        self.forwards += 1
        meta = ForwardMeta(start=start, mask=mask, kv_len=kv_len, logits_idx=logits_idx, row_lengths=row_lengths)
        return self.model.run(tokens, positions, cache, meta)


def _stash(cache: KVCache, row: int, held: list[int], prompt: list[int]) -> _Stash | None:
    """A copy of the row's keys/values over the longest common prefix of ``held`` and ``prompt``.

    Causal attention: a slot's keys/values depend only on the tokens up to it, so the common prefix
    is exact to reuse even where the follow-up diverges later (e.g. an answer whose text re-tokenizes
    differently, or a request whose surrounding whitespace was stripped). None when nothing is shared.
    """
    c = 0
    for a, b in zip(held, prompt[:-1], strict=False):  # keep >= 1 token to feed: it gives the logits
        if a != b:
            break
        c += 1
    if c == 0:
        return None
    return _Stash(cache.k[:, row, :, :c].clone(), cache.v[:, row, :, :c].clone())


def _groups(items: list, size: int, max_slots: int) -> list[list]:
    """Items (job, stash) cut into prefill groups of <= size rows whose padded writes fit the cache."""
    out = []
    for s in range(0, len(items), size):
        group = items[s : s + size]
        t = max(len(j.prompt) - (st.tokens if st else 0) for j, st in group)
        if len(group) > 1 and max((st.tokens if st else 0) for _, st in group) + t > max_slots:
            half = len(group) // 2
            out += _groups(group[:half], size, max_slots) + _groups(group[half:], size, max_slots)
        else:
            out.append(group)
    return out


class _ListJobs:
    """A fixed list of jobs; results by key."""

    def __init__(self, jobs: list[Job]) -> None:
        self.todo = list(reversed(jobs))
        self.results: dict[object, Completion] = {}

    def next_job(self) -> Job | None:
        return self.todo.pop() if self.todo else None

    def done(self, job: Job, completion: Completion) -> None:
        self.results[job.key] = completion
        return None
