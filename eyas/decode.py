"""The speculative decoder: prefill, then step = draft -> verify -> commit.

Plain decoding is the same loop with no drafter (every tree is the root alone),
so plain and speculative outputs go through one code path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from eyas import kernels
from eyas.drafters.base import Drafter, TargetFeatures
from eyas.kv.prefix import PrefixStore, PromptRecord
from eyas.models.attention import round_up
from eyas.models.base import ForwardMeta, ForwardOutput, PathAttention, TargetModel
from eyas.models.exact import MAX_ROWS
from eyas.tree import make_tree
from eyas.types import DraftOutput, SamplingParams, StepStats, Tree, VerifyOutput
from eyas.verify import TypicalConfig, logits_to_probs, sample, verify_greedy, verify_sampling, verify_typical

# exact-mode prefill (prefill_spans, SpecDecoder.prefill_steps): chunk boundaries fall on multiples of
# PREFILL_QUANTUM (the projections' row floors); attention runs on the compiled path kernel where the target
# has one (eyas.models.native.causal_paths: a row's bits depend only on the keys it attends), else torch's CPU
# flash attention over key lengths on multiples of PREFILL_KV_BLOCK (its key block). Either way no query's
# arithmetic depends on how the prompt was chunked (measured on SmolLM2 with chunks of 8 to 1,280 tokens, and
# in tests/test_prefill.py)
PREFILL_QUANTUM = 8
PREFILL_KV_BLOCK = 512
# a prompt token's projections cost about what attending this many keys costs (SmolLM2 on the 2-core VM:
# 0.3 ms per token + 0.45 us per cached key), the unit of next_span's budget
PREFILL_TOKEN_KEYS = 640
# exact mode's prefill forwards hold at most this many prompt tokens (longer chunks are split, which changes no bit):
# the path kernel's causal rows carry a [T, T] slot table (eyas.models.native.causal_paths), 2 MB at 512
EXACT_PREFILL_ROWS = 512


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


@dataclass
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    # lossy Medusa typical acceptance instead of exact verification (None = lossless)
    typical: TypicalConfig | None = None
    # bf16 row invariance: a token's logits do not depend on how many tokens share its forward,
    # so speculative output equals plain (drafter none) output bit for bit (eyas.models.attention)
    exact: bool = False
    # prompt tokens per prefill forward (a multiple of PREFILL_QUANTUM); continuous batching chooses its own,
    # smaller chunks (eyas.batch), which in exact mode fill the same cache bits (prefill_spans)
    prefill_chunk: int = 128
    # exact mode keeps one copy of the KV cache per tree node for tree attention (PathAttention) up to this size
    max_mirror_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class StepEvent:
    """Tokens emitted by one decoder step (prefill emits the first token)."""

    # [A + 1] long new tokens (truncated at a stop token or the token budget)
    tokens: torch.Tensor
    # how many of them were drafted and accepted (the rest came from the target alone)
    num_accepted: int
    finished: bool


@dataclass
class SeqState:
    """One sequence's decoding state (a batch row's too: eyas.batch keeps one per row)."""

    history: torch.Tensor  # [n] long, all tokens, the last one (root) not yet in the cache
    cache: object
    cached: int  # slots holding committed tokens
    # exact mode with path attention: W rows, each a copy of the committed prefix (PathAttention)
    mirror: object | None = None
    emitted: int = 0
    finished: bool = False


# (draft, the target's logits [N, V], the generator, the logits' argmax [N] where the forward found it, else None)
Verifier = Callable[[DraftOutput, torch.Tensor, torch.Generator | None, torch.Tensor | None], VerifyOutput]
# (start, prompt length) -> the end of the prefill chunk that starts there (SpecDecoder.prefill_steps)
ChunkEnd = Callable[[int, int], int]


def make_verifier(cfg: DecodeConfig) -> Verifier:
    """Pick the verification rule once, so step() has no mode branches."""
    sp = cfg.sampling
    if cfg.typical is not None:
        return lambda d, logits, g, top: verify_typical(d.tree, logits, sp.temperature, cfg.typical)
    if sp.greedy:
        return lambda d, logits, g, top: verify_greedy(d.tree, logits, kernels.argmax(logits) if top is None else top)
    return lambda d, logits, g, top: verify_sampling(d, logits_to_probs(logits, sp), g)


class SpecDecoder:
    """Generates with a target and an optional drafter (batch size 1)."""

    def __init__(
        self, target: TargetModel, drafter: Drafter | None, cfg: DecodeConfig, prefix: PrefixStore | None = None
    ) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg
        # prompts prefilled earlier (eyas.kv.prefix): exact mode reuses their longest shared prefix
        if prefix is not None and prefix.cfg.quantum % PREFILL_QUANTUM:
            raise ValueError(f"a prefix cache's quantum must be a multiple of {PREFILL_QUANTUM} (prefill's chunk "
                             f"boundaries, where reuse keeps every bit), got {prefix.cfg.quantum}")
        self.prefix = prefix
        self.cached_prompt_tokens = 0  # of the last prompt, slots taken from ``prefix`` instead of prefilled
        self.verifier = make_verifier(cfg)
        self.width = drafter.max_nodes if drafter is not None else 1
        if cfg.exact and self.width > MAX_ROWS:
            raise ValueError(
                f"exact mode verifies trees of up to {MAX_ROWS} nodes, but the drafter's trees have up to "
                f"{self.width}; shrink the tree (--total-tokens) or pass --no-exact"
            )
        self.taps = drafter.taps if drafter is not None else ()
        # greedy verification and the first token read only the target's argmax (ForwardMeta.argmax_only)
        self.argmax_only = cfg.sampling.greedy and cfg.typical is None
        self.stats = StepStats()
        self.generator = None
        if cfg.seed is not None:
            self.generator = torch.Generator(device=target.device).manual_seed(cfg.seed)

    # ---- the loop -------------------------------------------------------------------------
    def generate(self, prompt: torch.Tensor) -> Iterator[StepEvent]:
        """prompt: [T] long. Yields the new tokens of every step until a stop."""
        seq = self.prefill(prompt)
        first = seq.history[-1:]
        yield self.emit(seq, first, 0)
        while not self._done(seq):
            ver = self.step(seq)
            yield self.emit(seq, ver.tokens, ver.num_accepted)

    def step(self, seq: SeqState) -> VerifyOutput:
        """draft -> verify -> commit. eyas.batch runs the same verbs, with one forward for all rows."""
        draft = self.draft(seq)
        out = self.verify_forward(seq, draft.tree)
        return self.accept(seq, draft, out)

    def accept(self, seq: SeqState, draft: DraftOutput, out: ForwardOutput) -> VerifyOutput:
        """Verify the draft against the target's logits ([1, N, V] in ``out``) and commit what it keeps."""
        ver = self.verifier(draft, out.logits[0], self.generator, None if out.greedy is None else out.greedy[0])
        self.commit(seq, draft.tree, ver, out)
        self.stats.record(draft.tree.num_nodes - 1, ver.num_accepted)
        return ver

    # ---- the three verbs ------------------------------------------------------------------
    def draft(self, seq: SeqState) -> DraftOutput:
        if self.drafter is None:
            return root_only(seq)
        return self.drafter.propose(seq.history, self.cfg.sampling, self.generator)

    def verify_forward(self, seq: SeqState, tree: Tree) -> ForwardOutput:
        """One target forward over the tree nodes at slots after the cached prefix."""
        n, start = tree.num_nodes, seq.cached
        positions = start + tree.depth
        paths = self.path_attention(seq, tree)
        if paths is not None:
            return self._forward(tree.tokens, positions, seq.cache, start, None, paths=paths)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=tree.mask.device)
        mask[:, start:] = tree.mask
        return self._forward(tree.tokens, positions, seq.cache, start, mask)

    def path_attention(self, seq: SeqState, tree: Tree) -> PathAttention | None:
        """Exact mode: each node attends prefix + its own path in consecutive slots, as plain decoding lays
        them out (a one-node tree attends the sequence's own cache). None outside exact mode, or without a mirror.
        """
        n = tree.num_nodes
        if not (self.cfg.exact and self.target.path_attention):
            return None
        kernel = self.target.path_kernel()
        if not (n == 1 or seq.mirror is not None or kernel is not None):
            return None
        return PathAttention.from_tree_mask(
            tree.mask, seq.cached, round_up(seq.cached + n), None if n == 1 else seq.mirror, kernel
        )

    def commit(self, seq: SeqState, tree: Tree, ver: VerifyOutput, out: ForwardOutput) -> None:
        """Move accepted KV entries into place, extend history, feed the drafter."""
        self.target.commit(seq.cache, seq.cached, ver.path)
        if seq.mirror is not None:
            seq.mirror.broadcast_from(seq.cache, seq.cached, seq.cached + ver.path.shape[0])
        seq.cached += ver.path.shape[0]
        seq.history = torch.cat([seq.history, ver.tokens])
        if self.drafter is not None:
            self.drafter.extend(ver.tokens, _features(out, ver.path))

    # ---- prefill and helpers ---------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor, cache=None) -> SeqState:
        """prompt: [T] long. ``cache``: a 1-row cache to fill (a batch row), else a new one."""
        *_, seq = self.prefill_steps(prompt, cache)
        return seq

    def prefill_steps(
        self, prompt: torch.Tensor, cache=None, next_end: ChunkEnd | None = None
    ) -> Iterator[SeqState | None]:
        """Prefill in chunks: yields None after every chunk but the last, then the SeqState. Continuous
        batching (eyas.batch) runs one chunk per step between decode steps; the chunking does not change the
        cache (below), so a served prompt's cache holds the same bits as eyas generate's.

        ``next_end(s, t)``: the end of the chunk that starts at ``s`` of a ``t``-token prompt, asked when
        that chunk's turn comes; a multiple of PREFILL_QUANTUM unless ``t`` (default: ``next_span`` with
        ``cfg.prefill_chunk``). In exact mode every chunk attends a key length rounded up to PREFILL_KV_BLOCK
        and pads its projections to their row floors; with chunk boundaries on multiples of PREFILL_QUANTUM
        that makes the cache bits independent of the chunking (measured, tests/test_prefill.py), so a server
        can prefill in small chunks between decode steps and still give the tokens of eyas generate. (Where
        the target has the compiled path kernel, exact prefill attends through it instead, unpadded:
        eyas.models.native.causal_paths.) For the same reason exact mode starts after the longest prefix
        ``self.prefix`` holds (a multiple of PREFILL_QUANTUM), copied rather than computed.
        """
        prompt = prompt.to(self.target.device)  # callers' ids come from the tokenizer, on the CPU
        t = prompt.shape[0]
        budget = t + self.cfg.max_new_tokens + self.width + 1
        limit = self.target.config.max_position_embeddings
        if t + self.cfg.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {t} tokens + max_new_tokens {self.cfg.max_new_tokens} exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )
        self.stats = StepStats()
        exact = self.cfg.exact and self.target.path_attention
        if exact:
            budget = max(budget, round_up(t, PREFILL_KV_BLOCK))
        cache = cache if cache is not None else self._new_cache(budget)
        mirror = self._new_mirror(cache, budget)
        if self.drafter is not None:
            self.drafter.start(budget)
        next_end = next_end or (lambda s, t: next_span(s, t, self.cfg.prefill_chunk))
        keep = PromptRecord() if exact and self.prefix is not None else None
        reused = self._reuse_prefix(prompt, cache, mirror, keep) if keep is not None else 0
        self.cached_prompt_tokens = reused
        for s, e in _chunks(reused, t, next_end, EXACT_PREFILL_ROWS if exact else None):
            if s > reused:
                yield None
            kv_len = round_up(e, PREFILL_KV_BLOCK) if exact else None
            out = self._forward(
                prompt[s:e], torch.arange(s, e, device=prompt.device), cache, s, None, prefill=True, kv_len=kv_len
            )
            if mirror is not None:
                mirror.broadcast_from(cache, s, e)
            if self.drafter is not None:  # a plain decoder reads no features (and its store entry keeps none)
                feats = _features(out, torch.arange(e - s, device=prompt.device))
                if keep is not None:
                    keep.add(feats.hidden, feats.taps)
                if e < t:  # the drafter follows chunk by chunk (no long stall at the end)
                    self.drafter.extend(prompt[s + 1 : e + 1], feats)
        first = self._sample_first(out.logits[0, -1], None if out.greedy is None else out.greedy[0, -1:])
        if self.drafter is not None:
            self.drafter.extend(torch.cat([prompt[s + 1 :], first]), feats)
        if keep is not None:
            self.prefix.keep(prompt, cache, keep)
        yield SeqState(history=torch.cat([prompt, first]), cache=cache, cached=t, mirror=mirror)

    def _reuse_prefix(self, prompt: torch.Tensor, cache, mirror, keep: PromptRecord) -> int:
        """Copy the longest stored prefix of ``prompt`` into ``cache`` and feed it to the drafter; its length."""
        taps = self.taps if self.drafter is not None else None
        hit = self.prefix.lookup(prompt, cache.k.dtype, taps)
        if hit is None:
            return 0
        n = hit.length
        hit.copy_into(cache)
        if mirror is not None:
            mirror.broadcast_from(cache, 0, n)
        if self.drafter is not None:
            feats = TargetFeatures(*hit.features(self.taps))
            keep.add(feats.hidden, feats.taps)
            self.drafter.extend(prompt[1 : n + 1], feats)
        return n

    def _new_cache(self, budget: int):
        """The sequence's KV cache. Exact mode on the compiled path kernel: in ``decode_kv_dtype`` (bf16 for a bf16
        model where the kernels read it: the same values as float32, half the bytes every decode step streams).
        """
        t = self.target
        if self.cfg.exact and t.path_attention and t.path_kernel() is not None and hasattr(t, "decode_kv_dtype"):
            return t.new_cache(1, budget, t.decode_kv_dtype())
        return t.new_cache(1, budget)

    def _new_mirror(self, cache, budget: int):
        """Exact mode's per-row cache copies (PathAttention), when the target supports them and they fit."""
        if not (self.cfg.exact and self.target.path_attention and self.width > 1):
            return None
        if self.target.path_kernel() is not None:
            return None  # the compiled kernel reads the shared cache: no copies
        if self.width * cache.nbytes > self.cfg.max_mirror_bytes:
            return None  # too large: trees are verified in one shared layout (plain steps stay exact, trees may drift)
        return self.target.new_cache(self.width, budget)

    def _forward(self, tokens, positions, cache, start, mask, prefill=False, paths=None, kv_len=None) -> ForwardOutput:
        """tokens, positions: [T]; mask: [T, S] or None (causal). Adds the batch dim. kv_len: exact-mode prefill."""
        t = tokens.shape[0]
        meta = ForwardMeta(
            start=start,
            mask=None if mask is None else mask[None],
            taps=self.taps,
            paths=None if paths is None else [paths],
            kv_len=kv_len,
            exact=kv_len is not None,
            logits_idx=torch.tensor([t - 1], device=tokens.device) if prefill else None,
            argmax_only=self.argmax_only,
        )
        return self.target.run(tokens[None], positions[None], cache, meta)

    def _sample_first(self, logits: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
        """logits [V] -> [1] long, the first generated token (greedy: [1] long, its argmax where the forward found
        it).
        """
        sp = self.cfg.sampling
        if sp.greedy:
            return logits.argmax(-1, keepdim=True) if greedy is None else greedy
        return sample(logits_to_probs(logits, sp), self.generator).reshape(1)

    def emit(self, seq: SeqState, tokens: torch.Tensor, num_accepted: int) -> StepEvent:
        left = self.cfg.max_new_tokens - seq.emitted
        tokens = tokens[:left]
        stops = [i for i, tok in enumerate(tokens.tolist()) if tok in self.cfg.stop_ids]
        hit_stop = bool(stops)
        if hit_stop:
            tokens = tokens[: stops[0] + 1]
        seq.emitted += tokens.shape[0]
        seq.finished = hit_stop or seq.emitted >= self.cfg.max_new_tokens
        return StepEvent(tokens=tokens, num_accepted=min(num_accepted, tokens.shape[0]), finished=seq.finished)

    @staticmethod
    def _done(seq: SeqState) -> bool:
        return seq.finished


def _chunks(s: int, t: int, next_end: ChunkEnd, most: int | None) -> Iterator[tuple[int, int]]:
    """Prefill chunks from ``s`` to ``t`` (each end asked of ``next_end`` when its turn comes), each at most
    ``most`` tokens (a multiple of PREFILL_QUANTUM; None: no bound).
    """
    while s < t:
        e = next_end(s, t)
        yield from split_spans([(s, e)], most) if most else [(s, e)]
        s = e


def prefill_spans(t: int, chunk: int, pairs: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of each prefill forward over a ``t``-token prompt (see ``next_span``)."""
    return list(_chunks(0, t, lambda s, t: next_span(s, t, chunk, pairs), None))


def next_span(s: int, t: int, chunk: int, pairs: int | None = None) -> int:
    """End of the prefill chunk starting at ``s`` of ``t``: ``chunk`` tokens, or fewer n such that
    n * (s + PREFILL_TOKEN_KEYS) <= ``pairs``, never fewer than PREFILL_QUANTUM; every boundary but the
    prompt's end is a multiple of PREFILL_QUANTUM.

    Attention grows with the prefix while the projections do not: on the 2-core VM a 128-token chunk of
    SmolLM2 costs ~60 ms at the start of a prompt and ~560 ms after 7,800 tokens (fp32 attention at
    ~140 GFLOP/s, bf16 GEMMs at ~600), so continuous batching bounds ``pairs`` to keep every step short.
    """
    if chunk < PREFILL_QUANTUM or chunk % PREFILL_QUANTUM:
        raise ValueError(f"prefill chunk must be a positive multiple of {PREFILL_QUANTUM}, got {chunk}")
    n = chunk if pairs is None else min(chunk, pairs // (s + PREFILL_TOKEN_KEYS) // PREFILL_QUANTUM * PREFILL_QUANTUM)
    return min(t, s + max(n, PREFILL_QUANTUM))


def split_spans(spans: Iterable[tuple[int, int]], most: int) -> Iterator[tuple[int, int]]:
    """``spans`` with any span longer than ``most`` (a multiple of PREFILL_QUANTUM) cut into pieces of ``most``."""
    for s, e in spans:
        while e - s > most:
            yield s, s + most
            s += most
        yield s, e


def root_only(seq: SeqState) -> DraftOutput:
    """The tree of a plain step: the root (the last sampled token) alone (its shape tensors made once per device:
    ``make_tree``'s checks and mask ops cost a plain step ~0.14 ms, measured in the step on the Zen 5 VM).
    """
    root = seq.history[-1:]
    parents, depth, mask = _root_shape(root.device)
    return DraftOutput(tree=Tree(tokens=root, parents=parents, depth=depth, mask=mask))


@functools.cache
def _root_shape(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-node tree's parents [1], depth [1] and mask [1, 1], as ``make_tree`` builds them (read-only)."""
    t = make_tree(torch.zeros(1, dtype=torch.long, device=device), torch.full((1,), -1, device=device))
    return t.parents, t.depth, t.mask


def _features(out: ForwardOutput, rows: torch.Tensor) -> TargetFeatures:
    """The forward's features at ``rows`` [A] (the accepted path's nodes, or a prefill chunk's rows)."""
    a = rows.shape[0]
    if rows.device.type == "cpu" and rows.tolist() == list(range(a)):  # the first A rows: views, no gathers
        return TargetFeatures(hidden=out.hidden[0, :a], taps={k: v[0, :a] for k, v in out.taps.items()})
    return TargetFeatures(hidden=out.hidden[0, rows], taps={k: v[0, rows] for k, v in out.taps.items()})
