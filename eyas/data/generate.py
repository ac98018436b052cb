"""Batched plain generation with the native target: the engine behind ``eyas data``.

``BatchGenerator`` runs B prompts of different lengths as one batch:

- prompts are left-padded to the longest, T tokens: row b has ``pad_b = T - len_b``
  pad slots first, so every row's next token lands in the same cache slot;
- each row's RoPE positions start at 0 at its first real token;
- the mask [B, T, S] is causal AND "key slot holds a real token", so no row ever
  attends padding. A pad *query* attends only itself: a fully masked row would make
  SDPA return NaN, and the NaN would reach the values later layers read;
- one KV cache for the batch, then [B, 1] decode steps until every row has hit a
  stop id or its token budget. Finished rows leave the batch (the cache is compacted).

In float32 each row's tokens equal unbatched plain greedy decoding of that prompt
(``tests/data/test_generate.py``). ``NativeGenerator`` schedules conversations onto
it: a window of conversations is regenerated turn by turn (all first turns, then all
second turns, ...), each round sorted by prompt length into batches to limit padding,
and a conversation is reported as soon as its last turn is done.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from eyas.data.output import Sink, TurnAnswer, history_messages
from eyas.data.sources import Conversation
from eyas.kv.static import KVCache
from eyas.models.base import TargetModel, causal_mask
from eyas.types import SamplingParams
from eyas.verify import logits_to_probs, sample


@dataclass
class GenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # sampling only; one torch.Generator for the whole run
    batch_size: int = 16
    # conversations scheduled together; each round of their turns is sorted by prompt
    # length into batches (None: 8 batches' worth)
    window: int | None = None
    prefill_chunk: int = 256  # prompt tokens per prefill forward (bounds attention memory)

    def __post_init__(self) -> None:
        if self.window is None:
            self.window = 8 * self.batch_size
        for name in ("max_new_tokens", "batch_size", "prefill_chunk", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        SamplingParams(self.temperature, 0, self.top_p)  # validates both

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)


@dataclass
class Completion:
    # generated ids, the stop token included when one ended the row
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


class BatchGenerator:
    """Plain (non-speculative) batched decoding of token prompts on a native target."""

    def __init__(self, model: TargetModel, stop_ids: Sequence[int], cfg: GenConfig) -> None:
        self.model, self.cfg = model, cfg
        self.stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=model.device)
        self.generator = None
        if not cfg.sampling.greedy:
            self.generator = torch.Generator(device=model.device)
            if cfg.seed is not None:
                self.generator.manual_seed(cfg.seed)
            else:
                self.generator.seed()  # a fresh nondeterministic seed for this generator only

    def budget(self, prompt_len: int) -> int:
        """New tokens a prompt of this length may get: max_new_tokens, or less near the context end."""
        return min(self.cfg.max_new_tokens, self.model.config.max_position_embeddings - prompt_len)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Decode every prompt (lists of ids, any lengths) as one batch."""
        dev = self.model.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        budgets = torch.tensor([self.budget(len(p)) for p in prompts], device=dev)  # [B]
        if not prompts or int(lens.min()) < 1 or int(budgets.min()) < 1:
            raise ValueError("every prompt needs >= 1 token and room for >= 1 new token in the context")
        t, steps = int(lens.max()), int(budgets.max())
        tokens, valid = _left_pad(prompts, lens, t, steps)
        cache = self.model.new_cache(len(prompts), t + steps)
        logits = self._prefill(tokens, lens, valid, cache)  # [B, V]
        out = torch.zeros(len(prompts), steps, dtype=torch.long, device=dev)  # [B, steps]
        count = torch.zeros(len(prompts), dtype=torch.long, device=dev)  # [B] tokens emitted
        stopped = torch.zeros(len(prompts), dtype=torch.bool, device=dev)  # [B]
        rows = torch.arange(len(prompts), device=dev)  # [b] original row of each live batch row
        for i in range(steps):
            tok = self._pick(logits)  # [b]
            out[rows, i] = tok
            count[rows] = i + 1
            hit = torch.isin(tok, self.stop)
            stopped[rows] = hit
            live = ~(hit | (i + 1 >= budgets[rows]))  # [b]
            if not bool(live.all()):  # host sync, once per step: drop finished rows
                if not bool(live.any()):
                    break
                rows, valid, tok = rows[live], valid[live], tok[live]
                cache = _keep_rows(cache, live)
            start = t + i
            logits = self.model.forward(
                tok[:, None], (lens[rows] + i)[:, None], cache, start, mask=valid[:, None, : start + 1],
            ).logits[:, -1]
        return [
            Completion(out[b, : count[b]].tolist(), "stop" if stopped[b] else "length")
            for b in range(len(prompts))
        ]

    def _prefill(self, tokens: torch.Tensor, lens: torch.Tensor, valid: torch.Tensor, cache) -> torch.Tensor:
        """tokens [B, T] left-padded; valid [B, S] real-token slots. Returns last-token logits [B, V]."""
        t = tokens.shape[1]
        pad = t - lens  # [B]
        positions = (torch.arange(t, device=tokens.device)[None] - pad[:, None]).clamp(min=0)  # [B, T]
        for s in range(0, t, self.cfg.prefill_chunk):
            e = min(t, s + self.cfg.prefill_chunk)
            # [B, e - s, e]: causal AND real key; every query also sees itself (pad rows: only that)
            mask = causal_mask(e - s, s, device=tokens.device)[None] & valid[:, None, :e]
            idx = torch.arange(e - s, device=tokens.device)
            mask[:, idx, s + idx] = True
            last = torch.tensor([e - s - 1], device=tokens.device) if e == t else idx[:1]
            out = self.model.forward(tokens[:, s:e], positions[:, s:e], cache, s, mask=mask, logits_idx=last)
        return out.logits[:, -1]

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, V] -> [b] next tokens: argmax, or a seeded draw from the filtered distribution."""
        if self.generator is None:
            return logits.argmax(-1)
        return sample(logits_to_probs(logits, self.cfg.sampling), self.generator)


def _left_pad(prompts, lens: torch.Tensor, t: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows [B, T] padded on the left with id 0, and valid [B, T + steps] (real slots)."""
    dev = lens.device
    tokens = torch.zeros(len(prompts), t, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, t - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=dev)
    valid = torch.ones(len(prompts), t + steps, dtype=torch.bool, device=dev)
    valid[:, :t] = torch.arange(t, device=dev)[None] >= (t - lens)[:, None]
    return tokens, valid


def _keep_rows(cache, keep: torch.Tensor):
    """The cache of the rows where ``keep`` [b] is True (a copy; finished rows stop costing compute)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"batched generation needs the native KVCache, got {type(cache).__name__}")
    return KVCache(cache.k[:, keep], cache.v[:, keep])


# ---- conversations -> batches -------------------------------------------------------------------
class NativeGenerator:
    """Regenerates conversations with a loaded target (an ``eyas.api.Speculator``)."""

    def __init__(self, spec, cfg: GenConfig, stop_ids: Sequence[int] | None = None) -> None:
        self.spec, self.cfg = spec, cfg
        self.tokenizer = spec.tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {spec.target.name} has no chat template, so conversations cannot be "
                f"rendered; use an instruction-tuned (chat) model for --model"
            )
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else spec.stop_ids()
        self.engine = BatchGenerator(spec.target.model, self.stop_ids, cfg)

    def describe(self) -> dict:
        """Provenance stored with every output line."""
        c = self.cfg
        return {
            "backend": "eyas-native", "model": str(self.spec.target.name),
            "dtype": str(self.spec.target.model.dtype).removeprefix("torch."),
            "max_new_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p,
            "seed": c.seed,
        }

    def run(self, convs: Sequence[Conversation], sink: Sink) -> None:
        """Regenerate every conversation; each is reported to ``sink`` when its last turn is done."""
        for w in range(0, len(convs), self.cfg.window):
            self._run_window(convs[w : w + self.cfg.window], sink)

    def _run_window(self, convs: Sequence[Conversation], sink: Sink) -> None:
        answers: dict[str, list[TurnAnswer]] = {c.id: [] for c in convs}
        pending = list(convs)
        while pending:  # round k: the k-th turn of every conversation that has one
            jobs = []
            for conv in pending:
                ids = self.encode(history_messages(conv, answers[conv.id]))
                if self.engine.budget(len(ids)) < 1:
                    sink.skip(conv, f"turn {len(answers.pop(conv.id)) + 1} prompt of {len(ids)} tokens "
                                    f"leaves no room in the context")
                    continue
                jobs.append((conv, ids))
            for batch in _length_batches(jobs, self.cfg.batch_size):
                self._run_batch(batch, answers, sink)
            pending = [c for c, _ in jobs if c.id in answers]  # finished ones were popped

    def _run_batch(self, batch: list, answers: dict[str, list[TurnAnswer]], sink: Sink) -> None:
        completions = self.engine.generate([ids for _, ids in batch])
        sink.tokens(sum(len(c.token_ids) for c in completions))
        for (conv, ids), comp in zip(batch, completions, strict=True):
            answers[conv.id].append(TurnAnswer(
                text=self.decode(comp.token_ids), prompt_tokens=len(ids),
                completion_tokens=len(comp.token_ids), finish_reason=comp.finish_reason,
            ))
            if len(answers[conv.id]) == len(conv.turns):
                sink.done(conv, answers.pop(conv.id))

    def encode(self, messages: list[dict]) -> list[int]:
        """Chat template with the generation prompt -> ids (the same path as ``eyas generate``)."""
        return self.spec.encode(messages).tolist()

    def decode(self, ids: list[int]) -> str:
        """Answer text: a final stop token is not part of it."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _length_batches(jobs: list, batch_size: int) -> Iterator[list]:
    """Jobs (conv, ids) sorted by prompt length, cut into batches (stable for equal lengths)."""
    jobs = sorted(jobs, key=lambda j: len(j[1]))
    for s in range(0, len(jobs), batch_size):
        yield jobs[s : s + batch_size]
