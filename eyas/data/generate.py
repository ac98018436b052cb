"""Conversations -> jobs for the continuous-refill engine (``eyas.data.engine``): ``eyas data``, native.

``NativeGenerator.run`` regenerates conversations turn by turn: conversations are read in windows
whose first turns are sorted by prompt length (rows prefilled together then pad little). The next
turn of a conversation continues in the row of the turn before (the engine reuses its keys/values
when the new prompt extends them), and a conversation is written as soon as its last turn is done.
A Magpie source (``eyas.data.magpie``) can run alongside in the same batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from eyas.data.engine import Completion, EngineConfig, Job, RefillEngine
from eyas.data.output import Sink, TurnAnswer, history_messages
from eyas.data.sources import Conversation
from eyas.types import SamplingParams


@dataclass
class GenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # sampling only; one torch.Generator for the whole run
    batch_size: int = 64  # rows decoded together
    # conversations whose first turns are encoded and sorted by prompt length together (None: 4 batches)
    window: int | None = None
    prefill_chunk: int = 256  # prompt tokens per row per prefill forward
    prefill_rows: int = 16  # prompts prefilled in one forward
    refill_at: int | None = None  # free rows that trigger a refill (None: batch_size // 8)
    max_slots: int = 2048  # KV slots per row: prompt + answer (bounds the cache's memory)

    def __post_init__(self) -> None:
        if self.window is None:
            self.window = 4 * self.batch_size
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self.engine()  # validates the engine fields
        self.sampling  # noqa: B018 - validates temperature and top_p

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    def engine(self) -> EngineConfig:
        return EngineConfig(batch_size=self.batch_size, max_new_tokens=self.max_new_tokens,
                            prefill_chunk=self.prefill_chunk, prefill_rows=self.prefill_rows,
                            refill_at=self.refill_at, max_slots=self.max_slots, seed=self.seed)


class NativeGenerator:
    """Regenerates conversations with a loaded target (an ``eyas.api.Speculator``)."""

    def __init__(self, spec, cfg: GenConfig, stop_ids: Sequence[int] | None = None,
                 user_sampling: SamplingParams | None = None) -> None:
        self.spec, self.cfg = spec, cfg
        self.tokenizer = spec.tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {spec.target.name} has no chat template, so conversations cannot be "
                f"rendered; use an instruction-tuned (chat) model for --model"
            )
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else spec.stop_ids()
        # mode 0: assistant answers; mode 1: user turns the target writes itself (Magpie)
        self.user_sampling = user_sampling
        modes = [cfg.sampling] + ([user_sampling] if user_sampling is not None else [])
        self.engine = RefillEngine(spec.target.model, self.stop_ids, cfg.engine(), modes)

    def describe(self) -> dict:
        """Provenance stored with every output line."""
        c, u = self.cfg, self.user_sampling
        out = {
            "backend": "eyas-native", "model": str(self.spec.target.name),
            "dtype": str(self.spec.target.model.dtype).removeprefix("torch."),
            "max_new_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p,
            "seed": c.seed,
        }
        if u is not None:  # Magpie: how the user requests were sampled
            out.update(user_temperature=u.temperature, user_top_p=u.top_p)
        return out

    def run(self, convs: Sequence[Conversation], sink: Sink, extra=None) -> None:
        """Regenerate every conversation (and run ``extra``, e.g. a ``MagpieJobs``, in the same batch)."""
        schedulers = [ConversationJobs(self, convs, sink)] + ([extra] if extra is not None else [])
        self.engine.run(_Chain(schedulers))

    def encode(self, messages: list[dict]) -> list[int]:
        """Chat template with the generation prompt -> ids (the same path as ``eyas generate``)."""
        return self.spec.encode(messages).tolist()

    def decode(self, ids: list[int]) -> str:
        """Turn text: a final stop token is not part of it."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def answer(self, ids: list[int], comp: Completion) -> TurnAnswer:
        return TurnAnswer(text=self.decode(comp.token_ids), prompt_tokens=len(ids),
                          completion_tokens=len(comp.token_ids), finish_reason=comp.finish_reason)


class ConversationJobs:
    """Jobs for the turns of fixed conversations (see the module docstring for the order)."""

    def __init__(self, gen: NativeGenerator, convs: Sequence[Conversation], sink: Sink) -> None:
        self.gen, self.sink = gen, sink
        self.windows = _windows(convs, gen.cfg.window)
        self.queue: deque[Job] = deque()
        self.answers: dict[str, list[TurnAnswer]] = {}

    def next_job(self) -> Job | None:
        while not self.queue:
            window = next(self.windows, None)
            if window is None:
                return None
            jobs = [j for j in (self._job(c) for c in window) if j is not None]
            self.queue.extend(sorted(jobs, key=lambda j: len(j.prompt)))
        return self.queue.popleft()

    def done(self, job: Job, comp: Completion) -> Job | None:
        """Record the answer; the conversation's next turn is the follow-up (it continues in this row)."""
        conv: Conversation = job.key
        self.sink.tokens(len(comp.token_ids))
        self.answers[conv.id].append(self.gen.answer(job.prompt, comp))
        if len(self.answers[conv.id]) == len(conv.turns):
            self.sink.done(conv, self.answers.pop(conv.id))
            return None
        return self._job(conv)

    def _job(self, conv: Conversation) -> Job | None:
        """The job of the conversation's next turn, or None (skipped: no room in the context)."""
        answers = self.answers.setdefault(conv.id, [])
        ids = self.gen.encode(history_messages(conv, answers))
        if self.gen.engine.budget(len(ids)) < 1:
            self.answers.pop(conv.id)
            self.sink.skip(conv, f"turn {len(answers) + 1} prompt of {len(ids)} tokens leaves no room in the context "
                                 f"(or --max-slots)")
            return None
        return Job(conv, ids)


class _Chain:
    """Several schedulers feeding one engine: jobs are asked from each in order, results go back to their owner."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def next_job(self) -> Job | None:
        for i, s in enumerate(self.schedulers):
            job = s.next_job()
            if job is not None:
                return replace(job, key=_Owned(i, job))
        return None

    def done(self, job: Job, comp: Completion) -> Job | None:
        owner = job.key.owner
        follow = self.schedulers[owner].done(job.key.job, comp)
        return None if follow is None else replace(follow, key=_Owned(owner, follow))


@dataclass
class _Owned:
    owner: int  # index of the scheduler that made the job
    job: Job


def _windows(convs: Sequence[Conversation], size: int) -> Iterator[Sequence[Conversation]]:
    for w in range(0, len(convs), size):
        yield convs[w : w + size]
