"""Public Python API: load a target and a drafter, then generate or stream.

import eyas
spec = eyas.load(drafter="ngram")                      # embedded default model
out = spec.generate("Write a haiku about rain.", max_new_tokens=64)
print(out.text, out.mean_accepted, out.tokens_per_second)
for piece in spec.stream([{"role": "user", "content": "Hi!"}]):
print(piece, end="", flush=True)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from eyas.autotree import size_tree_for
from eyas.batch import BatchDecoder
from eyas.decode import DecodeConfig, SpecDecoder, StepEvent
from eyas.detok import Detokenizer
from eyas.drafters.loading import DrafterSpec, build_drafter
from eyas.kv.prefix import PrefixStore
from eyas.models.exact import exact_by_default
from eyas.models.loading import LoadedTarget, load_target
from eyas.policy import PolicyConfig, SpecPolicy
from eyas.types import RequestSettings, SamplingParams, mean_accepted
from eyas.verify import TypicalConfig

Prompt = str | list[dict]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    prompt_tokens: int
    steps: int  # target forwards after prefill
    drafted: int
    accepted: int
    seconds: float  # prefill + decode wall time
    prefill_seconds: float = 0.0  # until the first token (prompt processing)
    accepted_per_pos: list[int] = field(default_factory=list)
    # per emitted token: True if it was drafted and accepted, False if the target produced it
    from_draft: list[bool] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (Speculator.prefix_cache), not prefilled

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        """Tokens per target step after prefill, tau = 1 + accepted / steps (vLLM's definition)."""
        return mean_accepted(self.accepted, self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text, "token_ids": self.token_ids, "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens, "steps": self.steps, "drafted": self.drafted,
            "accepted": self.accepted, "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_second": round(self.tokens_per_second, 3), "seconds": round(self.seconds, 4),
            "accepted_per_pos": self.accepted_per_pos, "cached_tokens": self.cached_tokens,
        }


class Speculator:
    """A loaded target + drafter pair."""

    def __init__(self, target: LoadedTarget, drafter_spec: DrafterSpec, exact: bool | None = None) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.drafter_spec = drafter_spec
        self.drafter = build_drafter(drafter_spec, target)
        # exact (batch-invariant) verification: on by default below fp32, and in float32 where it is the faster mode
        self.exact = exact if exact is not None else exact_by_default(target.model)
        if self.exact and hasattr(target.model, "prepare_exact"):
            target.model.prepare_exact()  # row-floor probes at load, not inside the first timed generation
        self.tree_choice = None  # eyas.autotree's TreeChoice when load() sized the tree to this machine
        # prompts prefilled earlier, reused by later prompts that start with them (exact mode; load's prefix_cache_mb)
        self.prefix_cache: PrefixStore | None = None

    def encode(self, prompt: Prompt, chat: bool = True) -> torch.Tensor:
        """Prompt text or chat messages -> [T] long ids (chat template applied when there is one)."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not (chat and tok.chat_template):
            return torch.tensor(tok(prompt)["input_ids"], dtype=torch.long)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages:
            raise ValueError("messages must not be empty")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def stop_ids(self) -> tuple[int, ...]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.target.model, "eos_ids", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = self.tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return tuple(sorted(ids))

    def decoder(self, speculate: bool = True, typical: TypicalConfig | None = None, exact: bool | None = None,
                fork: bool = False, settings: RequestSettings | None = None, **params) -> SpecDecoder:
        """A decoder for one sequence. fork: give it its own drafter state (concurrent sequences).

        settings: a request's typed settings (the server's path); they replace ``speculate`` and the
        sampling / length / seed keyword ``params``.
        """
        if settings is not None:
            speculate, sampling = settings.speculate, settings.sampling
            params = {**params, "max_new_tokens": settings.max_new_tokens, "seed": settings.seed}
        else:
            sampling = SamplingParams(
                temperature=params.pop("temperature", 0.0) or 0.0,
                top_k=params.pop("top_k", 0) or 0,
                top_p=params.pop("top_p", 1.0) or 1.0,
            )
        exact = self.exact if exact is None else exact
        cfg = DecodeConfig(sampling=sampling, stop_ids=self.stop_ids(), typical=typical, exact=exact, **params)
        drafter = self.drafter if speculate else None
        if drafter is not None and fork:
            drafter = drafter.fork()
        return SpecDecoder(self.target.model, drafter, cfg, self.prefix_cache)

    def batch_decoder(self, max_batch: int, policy: PolicyConfig | None = None) -> BatchDecoder:
        """Continuous batching (``eyas.batch``): rows join and leave between steps.

        Rows are added with the ``decoder`` keyword arguments; with a drafter, a
        ``SpecPolicy`` picks each step's tree width from the batch size (cutting a tree changes
        no token, exact mode included).
        """
        spec_policy = None
        if self.drafter is not None:
            policy = policy or PolicyConfig()
            spec_policy = SpecPolicy(self.drafter.max_nodes, policy)
        taps = self.drafter.taps if self.drafter is not None else ()
        make = functools.partial(self.decoder, fork=True)
        return BatchDecoder(self.target.model, make, max_batch, spec_policy, taps, exact=self.exact)

    def events(self, prompt: Prompt, chat: bool = True, speculate: bool = True, **params):
        """Return (decoder, prompt ids [T], iterator of StepEvents): the lowest-level streaming API."""
        ids = self.encode(prompt, chat)
        dec = self.decoder(speculate=speculate, **params)
        return dec, ids, dec.generate(ids)

    def warm_up(self) -> None:
        """One two-token greedy generation, speculative where a drafter is loaded, so that first-use work (the block
        kernel's packed layouts, the output screen, the decode plan, the head's kernels: ~0.14 s of the embedded
        default's first request on the Intel Xeon 6/207) happens now rather than inside the first request or timed
        generation, as llama.cpp warms up at load. Greedy: no random numbers drawn; the drafter starts afresh at
        every sequence.
        """
        self.generate("Hello", max_new_tokens=2)

    def generate(self, prompt: Prompt, chat: bool = True, speculate: bool = True, **params) -> GenerationResult:
        """Generate a completion. params: max_new_tokens, temperature, top_p, top_k, seed, typical."""
        dec, ids, events = self.events(prompt, chat, speculate, **params)
        t0 = time.perf_counter()
        new, flags, prefill = [], [], None
        for ev in events:
            prefill = time.perf_counter() - t0 if prefill is None else prefill
            new += ev.tokens.tolist()
            flags += _flags(ev)
        seconds = time.perf_counter() - t0
        s = dec.stats
        return GenerationResult(
            text=self.tokenizer.decode(new, skip_special_tokens=True), token_ids=new,
            prompt_tokens=int(ids.shape[0]), steps=s.steps, drafted=s.drafted, accepted=s.accepted,
            seconds=seconds, accepted_per_pos=list(s.accepted_per_pos), from_draft=flags,
            prefill_seconds=prefill or 0.0, cached_tokens=dec.cached_prompt_tokens,
        )

    def stream(self, prompt: Prompt, chat: bool = True, speculate: bool = True, **params) -> Iterator[str]:
        """Yield text pieces as tokens are accepted."""
        for piece, _ in self.stream_events(prompt, chat, speculate, **params):
            if piece:
                yield piece

    def stream_events(self, prompt: Prompt, chat: bool = True, speculate: bool = True, **params):
        """Yield (text_delta, StepEvent) per step; text is decoded incrementally."""
        _, _, events = self.events(prompt, chat, speculate, **params)
        detok = Detokenizer(self.tokenizer)  # the serving engine's detokeniser too
        for ev in events:
            yield detok.push(ev.tokens.tolist(), ev.finished).text, ev


def _flags(ev: StepEvent) -> list[bool]:
    n = ev.tokens.shape[0]
    return [i < ev.num_accepted for i in range(n)]


def load(
    model: str | None = None,
    drafter: str = "default",
    dtype: str = "auto",
    backend: str = "native",
    tree: str | None = None,
    exact: bool | None = None,
    quantize: str | None = None,
    device: str | None = None,
    prefix_cache_mb: int = 0,
    warmup: bool = True,
    **drafter_options,
) -> Speculator:
    """Load a target (embedded default when ``model`` is None) and a drafter by name or path.

    ``dtype``: "auto" (as the command line's ``--dtype``): bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else
    float32; or "float32" / "bfloat16".

    ``exact=None`` turns batch-invariant verification on for bfloat16/float16, and for float32 where it is the
    faster mode (eyas.models.exact.exact_by_default: a GGUF target's blocks on a CPU); fast mode elsewhere.
    ``quantize="int8"``: weight-only int8 target (changes its outputs; speculation stays lossless w.r.t. it).
    ``prefix_cache_mb``: keep prefilled prompts up to this many MiB and start a prompt after the longest one it
    begins with (eyas.kv.prefix; exact mode only, where reuse changes no bit; 0: off, as for measuring).
    ``warmup``: end with ``Speculator.warm_up`` (first-use work at load, not in the first request).
    """
    if prefix_cache_mb < 0:
        raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the prefix cache off), got {prefix_cache_mb}")
    target = load_target(model, dtype, backend, quantize, device)
    spec = DrafterSpec(drafter, tree=tree, options=drafter_options)
    choice = size_tree_for(target, spec, exact)  # a tree sized to this machine, unless --tree is given
    if choice is not None:
        spec.tree = choice.spec
    out = Speculator(target, spec, exact=exact)
    out.tree_choice = choice
    if warmup:
        out.warm_up()
    out.prefix_cache = PrefixStore.sized(prefix_cache_mb)  # after the warm-up, which leaves nothing in it
    return out
