"""Magpie-style prompts: the target writes the user turn itself, then answers it.

Magpie (Xu et al. 2024, arXiv 2406.08464): an aligned chat model given only its chat template's
user prefix (for SmolLM2 ``<|im_start|>system ... <|im_end|> <|im_start|>user``, newlines after each) continues
with a plausible user request and ends it with its end-of-turn token. Sampled (``temperature`` >
0), every draw is another request, so data volume is not bound by a prompt file, and the
prompts carry no third-party licence: the data is the target's own output.

Each accepted request becomes a one-turn conversation whose id is ``magpie:<hash>``, the hash of
the request text after case folding and whitespace collapsing. Ids are therefore unique exactly
when requests are: a request already in the output file (or in flight) is dropped and another is
drawn. On a restart after a kill the ids already in the output file are both the dedupe set and
the count, so the file ends with exactly ``count`` Magpie conversations and no duplicate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from eyas.data.engine import Completion, Job
from eyas.data.output import Sink
from eyas.data.sources import Conversation
from eyas.types import SamplingParams

SOURCE = "magpie"
_SENTINEL = "\x00EYAS-MAGPIE\x00"


@dataclass
class MagpieConfig:
    count: int  # Magpie conversations the output file should hold (those already there included)
    temperature: float = 1.0  # sampling of the user turn (> 0: each draw another request)
    top_p: float = 1.0
    max_user_tokens: int = 256  # a request cut here is kept (it is still the target's own text)
    # give up after this many rejected draws (duplicates, empty requests) beyond count; None: 2 * count + 64
    max_rejects: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"the Magpie source needs a count >= 1 (--limit N), got {self.count}")
        if self.temperature <= 0:
            raise ValueError("Magpie needs a sampled user turn (--magpie-temperature > 0): greedy writes one "
                             "request over and over")
        if self.max_user_tokens < 1:
            raise ValueError(f"max_user_tokens must be >= 1, got {self.max_user_tokens}")
        if self.max_rejects is None:
            self.max_rejects = 2 * self.count + 64
        SamplingParams(self.temperature, 0, self.top_p)  # validates top_p

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)


def prompt_key(text: str) -> str:
    """The dedupe key of a request: case-folded, whitespace collapsed, hashed."""
    return hashlib.sha1(" ".join(text.casefold().split()).encode("utf-8")).hexdigest()[:16]


def user_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user message verbatim; cannot find its user prefix")
    return tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


class MagpieJobs:
    """Scheduler (``eyas.data.engine.Jobs``) of Magpie conversations: request jobs, then answer jobs.

    Requests are decoded in sampling mode 1 of the generator's engine, answers in mode 0 (the run's
    ``--temperature``); an accepted request's answer is its follow-up job, so it continues in the
    request's row (the chat prompt of the answer starts with the user prefix and the request).
    ``gen`` is the ``NativeGenerator`` (encode, decode, answer, engine budget).
    """

    def __init__(self, gen, cfg: MagpieConfig, done_ids: set[str], sink: Sink) -> None:
        self.gen, self.cfg, self.sink = gen, cfg, sink
        self.prefix = user_prefix(gen.tokenizer)
        self.seen = {i for i in done_ids if i.startswith(SOURCE + ":")}  # written, answering, or drawn
        self.written = len(self.seen)
        self.drawing = 0  # request jobs in rows
        self.rejects = 0

    @property
    def remaining(self) -> int:
        return max(0, self.cfg.count - self.written)

    def next_job(self) -> Job | None:
        in_flight = (len(self.seen) - self.written) + self.drawing  # accepted (not yet written) + drawing
        if in_flight >= self.remaining or self.rejects > self.cfg.max_rejects:
            return None
        self.drawing += 1
        return Job(None, self.prefix, mode=1, max_new_tokens=self.cfg.max_user_tokens, shared=True)

    def done(self, job: Job, comp: Completion) -> Job | None:
        """A drawn request -> its answer job (the follow-up, continuing the request's row) or None."""
        self.sink.tokens(len(comp.token_ids))
        if job.key is None:  # a request was drawn
            self.drawing -= 1
            return self._accept(self.gen.decode(comp.token_ids).strip())
        conv, ids = job.key
        self.written += 1
        self.sink.done(conv, [self.gen.answer(ids, comp)])
        return None

    def _accept(self, text: str) -> Job | None:
        key = f"{SOURCE}:{prompt_key(text)}"
        if not text or key in self.seen:
            self.rejects += 1
            return None
        conv = Conversation(id=key, source=SOURCE, turns=[[{"role": "user", "content": text}]])
        ids = self.gen.encode(conv.turns[0])
        if self.gen.engine.budget(len(ids)) < 1:
            self.rejects += 1
            return None
        self.seen.add(key)
        return Job((conv, ids), ids)

    def summary(self) -> str:
        return f"magpie: {self.written} of {self.cfg.count} conversations, {self.rejects} draws rejected " \
               f"(duplicate or empty requests)"
