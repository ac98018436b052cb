"""Continuous batching: many sequences, one target forward per step.

Every sequence (a *row*) keeps its own ``SpecDecoder`` -- sampling settings, generator,
drafter state, stop rules, statistics -- so a row decodes exactly as ``SpecDecoder`` would
alone. What the rows share is the verify forward: each drafts its tree, the trees are
padded to one width W and verified in a single forward over [B, W] tokens, each row at its
own committed length (``start`` is a [B] tensor, keys past a row's own tree are masked),
and then each row accepts its own number of tokens.

Rows join between steps (``add``; a prompt longer than one prefill chunk is prefilled one
chunk per ``step``, between decode steps, so a long prompt joining never stalls the running
rows for its whole prefill) and leave between steps (``remove`` moves the last row into the hole, so rows
0 .. B-1 stay contiguous and the forward runs on a view, never a gather). The cache grows
by doubling when a longer sequence arrives. In exact mode there is no shared cache: attention runs
row by row (``PathAttention``), so each row keeps the 1-row cache its prefill filled (``RowCaches``)
and a long prompt joining costs its own memory only, not every row grown to its length.

A ``SpecPolicy`` picks the verify width per step from the batch size (``eyas.policy``);
trees are cut to their first ``width`` nodes, which keeps verification lossless. Rows
sampling with an explicit seed keep full trees, so they reproduce ``eyas generate --seed``.

In float32 a row's greedy output equals its batch-1 output (tested); below float32 exact
(batch-invariant) mode makes every row's tokens those of ``eyas generate --drafter none`` at any
concurrency (tested); without it, larger batches change the key length and padding of each forward
and may flip near-tied argmaxes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from eyas.decode import SeqState, SpecDecoder, StepEvent, next_span, root_only
from eyas.kv.static import RowCaches
from eyas.models.base import ForwardMeta, ForwardOutput, TargetModel
from eyas.policy import SpecPolicy, calibrate
from eyas.types import DraftOutput, Tree


@dataclass
class PrefillBudget:
    """How much of a joining prompt one step prefills while rows decode (chunked prefill).

    Chunks hold at most ``chunk`` tokens and ``pairs`` units of work (``eyas.decode.next_span``: tokens times
    the keys they attend, plus the projections); ``pairs`` is steered multiplicatively so a chunk takes about
    ``share`` times the decode step it follows, so a long prompt joining slows every running stream by about
    ``1 + share`` whatever the machine. Chunk sizes never change a token: exact mode fills the same cache bits
    for any chunking (tests/test_prefill.py).
    """

    chunk: int = 64
    pairs: int = 1 << 15
    share: float = 1.0
    least: int = 1 << 12
    most: int = 1 << 20
    decode_s: float = 0.0  # moving average of the decode step

    def observe(self, decode_s: float, chunk_s: float) -> None:
        self.decode_s = decode_s if not self.decode_s else 0.8 * self.decode_s + 0.2 * decode_s
        factor = min(2.0, max(0.5, self.share * self.decode_s / max(chunk_s, 1e-6)))
        self.pairs = int(min(self.most, max(self.least, self.pairs * factor)))


@dataclass
class _Row:
    key: Hashable
    dec: SpecDecoder
    seq: SeqState


@dataclass
class _RowDraft:
    """One row's proposal for a batched step."""

    draft: DraftOutput  # the tree verified (cut to ``cut`` nodes)
    full_nodes: int  # nodes the drafter proposed; 0: the row did not draft (a plain step)
    cut: int  # the width the tree was cut to (the drafter's max_nodes: not cut)


@dataclass
class _Pending:
    """A row whose prompt is being prefilled, one chunk per step, in its own 1-row cache."""

    key: Hashable
    dec: SpecDecoder
    chunks: Iterator[SeqState | None]  # SpecDecoder.prefill_steps


def cut_tree(draft: DraftOutput, width: int) -> DraftOutput:
    """Keep the first ``width`` nodes (a valid tree: parents precede children)."""
    t = draft.tree
    if t.num_nodes <= width:
        return draft
    tree = Tree(t.tokens[:width], t.parents[:width], t.depth[:width], t.mask[:width, :width])
    return DraftOutput(tree=tree, q=None if draft.q is None else draft.q[:width])


class BatchDecoder:
    """Rows keyed by the caller's handles; ``step`` advances them all by one verify step."""

    def __init__(
        self,
        target: TargetModel,
        make_decoder: Callable[..., SpecDecoder],
        max_batch: int,
        policy: SpecPolicy | None = None,
        taps: tuple[int, ...] = (),
        initial_slots: int = 512,
        exact: bool = False,
    ) -> None:
        if max_batch > 1 and not target.row_starts:
            raise ValueError(
                f"{type(target).__name__} cannot verify rows of different lengths in one forward; "
                "use the native backend for batching, or a max batch of 1"
            )
        self.target, self.make_decoder, self.max_batch = target, make_decoder, max_batch
        self.policy, self.taps = policy, taps
        # exact mode: every row keeps its own cache (attention is per row); else one shared [B, S] cache
        self.own_caches = exact and target.path_attention
        self.cache = None if self.own_caches else target.new_cache(max_batch, initial_slots)
        self.rows: list[_Row] = []
        self.pending: list[_Pending] = []
        self.prefill = PrefillBudget()

    def __len__(self) -> int:
        return len(self.rows) + len(self.pending)

    def decoder(self, key: Hashable) -> SpecDecoder:
        pend = next((p for p in self.pending if p.key == key), None)
        return pend.dec if pend is not None else self.rows[self._index(key)].dec

    # ---- rows join and leave between steps -------------------------------------------------
    def add(self, key: Hashable, prompt: torch.Tensor, **params) -> StepEvent | None:
        """Start a row for ``prompt`` ([T] long).

        While no row decodes, its first prefill chunk runs now, and a prompt of one chunk returns its first
        token's event. Otherwise (and for the rest of a longer prompt) it returns None: ``step`` prefills one
        chunk per step, after the decode step (chunked prefill: running rows keep their inter-token latency),
        and emits the first token when the prompt is done.
        """
        if len(self) >= self.max_batch:
            raise RuntimeError(f"the batch is full ({self.max_batch} rows)")
        dec = self.make_decoder(**params)
        if self.own_caches and not dec.cfg.exact:
            raise ValueError("this batch runs in exact mode (per-row caches); its decoders need DecodeConfig.exact")
        pend = _Pending(key, dec, dec.prefill_steps(prompt, next_end=self._chunk_end(dec)))
        first = None if self.rows else self._advance(pend)
        if first is None:
            self.pending.append(pend)
        return first

    def _chunk_end(self, dec: SpecDecoder) -> Callable[[int, int], int]:
        """A joining prompt's chunks, each sized when its step comes: small while other rows decode, the
        decoder's own (eyas generate's) when none does. Exact mode fills the same cache bits either way.
        """

        def end(s: int, t: int) -> int:
            if self.rows:
                return next_span(s, t, self.prefill.chunk, self.prefill.pairs)
            return next_span(s, t, dec.cfg.prefill_chunk)

        return end

    def _advance(self, pend: _Pending) -> StepEvent | None:
        """Prefill one more chunk; when the prompt is done, move the row into the batch (its first event)."""
        seq = next(pend.chunks)
        if seq is None:
            return None
        if not self.own_caches:  # copy the prefilled row into the shared cache
            b, own = len(self.rows), seq.cache
            self._ensure_slots(seq.cached + pend.dec.cfg.max_new_tokens + pend.dec.width + 1)
            self.cache.k[:, b, :, : seq.cached] = own.k[:, 0, :, : seq.cached]
            self.cache.v[:, b, :, : seq.cached] = own.v[:, 0, :, : seq.cached]
            seq.cache = self.cache.rows(b, b + 1)
        self.rows.append(_Row(pend.key, pend.dec, seq))
        return pend.dec.emit(seq, seq.history[-1:], 0)

    def remove(self, key: Hashable) -> None:
        if any(p.key == key for p in self.pending):
            self.pending = [p for p in self.pending if p.key != key]
            return
        i, last = self._index(key), len(self.rows) - 1
        if self.own_caches:
            self.rows.pop(i)
            return
        if i != last:  # keep rows contiguous: the last row moves into the hole
            moved = self.rows[last]
            self.cache.copy_row(last, i, moved.seq.cached)
            moved.seq.cache = self.cache.rows(i, i + 1)
            self.rows[i] = moved
        self.rows.pop()

    # ---- one step: draft -> verify (one forward) -> commit, per row -------------------------
    def step(self) -> list[tuple[Hashable, StepEvent]]:
        """One decode step of the running rows, then one prefill chunk of the oldest joining row."""
        t0 = time.perf_counter()
        events = self._decode_step() if self.rows else []
        if self.pending:
            t1, pend = time.perf_counter(), self.pending[0]
            first = self._advance(pend)
            if events:  # rows decoded: steer the next chunk's size to this step's decode time
                self.prefill.observe(t1 - t0, time.perf_counter() - t1)
            if first is not None:
                self.pending.pop(0)
                events.append((pend.key, first))
        return events

    def _decode_step(self) -> list[tuple[Hashable, StepEvent]]:
        t0 = time.perf_counter()
        width = self.policy.width(len(self.rows)) if self.policy is not None else None
        drafts = [self._draft(r, width) for r in self.rows]
        drafting = time.perf_counter() - t0
        out, w = self.verify_forward([d.draft.tree for d in drafts])
        events = []
        for b, (row, rd) in enumerate(zip(self.rows, drafts, strict=True)):
            draft = rd.draft
            n = draft.tree.num_nodes
            out_b = ForwardOutput(
                out.logits[b : b + 1, :n],
                out.hidden[b : b + 1, :n],
                {k: v[b : b + 1, :n] for k, v in out.taps.items()},
                None if out.greedy is None else out.greedy[b : b + 1, :n],
            )
            dec = row.dec
            ver = dec.accept(row.seq, draft, out_b)
            if self.policy is not None and rd.full_nodes > 0:  # drafted, a miss (root only) included
                self.policy.curve.observe(rd.full_nodes, rd.cut, ver.path.tolist())
            events.append((row.key, dec.emit(row.seq, ver.tokens, ver.num_accepted)))
        if self.policy is not None:
            spent = time.perf_counter() - t0
            self.policy.cost.observe(len(self.rows) * w, len(self.rows), spent - drafting)
            drafted = sum(1 for d in drafts if d.full_nodes > 0)
            if drafted:
                self.policy.observe_draft(drafting / drafted)
        return events

    def _draft(self, row: _Row, width: int | None) -> _RowDraft:
        """The row's tree cut to ``width`` (None: not cut), and what the drafter proposed."""
        dec = row.dec
        if dec.cfg.seed is not None and not dec.cfg.sampling.greedy:
            width = None  # seeded sampling reproduces eyas generate only with the full trees
        # a row whose tree mirror did not fit (DecodeConfig.max_mirror_bytes: a very long prompt) verifies
        # plain steps in exact mode: its tokens stay those of --drafter none, only slower
        no_mirror = row.seq.mirror is None and self.target.path_kernel() is None
        if dec.drafter is None or width == 1 or (self.own_caches and no_mirror):
            return _RowDraft(root_only(row.seq), 0, 1)
        draft = dec.draft(row.seq)
        full = draft.tree.num_nodes
        if width is None:
            return _RowDraft(draft, full, dec.drafter.max_nodes)
        return _RowDraft(cut_tree(draft, width), full, width)

    def verify_forward(self, trees: list[Tree]) -> tuple[ForwardOutput, int]:
        """One target forward over every row's tree: [B, W] tokens at per-row slots."""
        if len(self.rows) == 1:  # batch 1: exactly SpecDecoder's forward (exact mode's path attention included)
            row = self.rows[0]
            return row.dec.verify_forward(row.seq, trees[0]), trees[0].num_nodes
        w = max(t.num_nodes for t in trees)
        starts = torch.tensor([r.seq.cached for r in self.rows], device=self.target.device)  # [B]
        kv_len = int(starts.max()) + w
        paths = [r.dec.path_attention(r.seq, t) for r, t in zip(self.rows, trees, strict=True)]
        exact = all(p is not None for p in paths)  # exact mode: every row attends exactly as it would alone
        tokens, positions, mask = _pack(trees, starts, w, None if exact else kv_len)
        b = len(self.rows)
        cache = RowCaches([r.seq.cache for r in self.rows]) if self.own_caches else self.cache.rows(0, b)
        if exact:
            greedy = all(r.dec.argmax_only for r in self.rows)
            meta = ForwardMeta(start=starts, paths=paths, taps=self.taps, argmax_only=greedy)
        else:
            meta = ForwardMeta(start=starts, mask=mask, kv_len=kv_len, taps=self.taps)
        return self.target.run(tokens, positions, cache, meta), w

    def calibrate(self, context: int = 128, repeats: int = 3) -> None:
        """Seed the policy's cost table: time one forward of n tokens after ``context`` slots."""
        if self.policy is None or self.policy.cfg.mode != "auto":
            return
        top = self.max_batch * self.policy.max_nodes
        scratch = self.target.new_cache(1, context + top)
        dev = self.target.device

        def forward(n: int) -> None:
            tokens = torch.zeros(1, n, dtype=torch.long, device=dev)
            positions = torch.arange(context, context + n, device=dev)[None]
            meta = ForwardMeta(start=context, taps=self.taps, logits_idx=torch.arange(n, device=dev))
            self.target.run(tokens, positions, scratch, meta)

        self.policy.cost = calibrate(forward, top, repeats)
        self.policy.cost.ema = self.policy.cfg.ema

    # ---- helpers ----------------------------------------------------------------------------
    def _index(self, key: Hashable) -> int:
        for i, r in enumerate(self.rows):
            if r.key == key:
                return i
        raise KeyError(f"no row for {key!r}")

    def _ensure_slots(self, need: int) -> None:
        """Grow the shared cache (doubling) so every row has ``need`` slots."""
        have = self.cache.max_slots
        if need <= have:
            return
        slots = max(need, 2 * have)
        bigger = self.target.new_cache(self.max_batch, slots)
        bigger.k[:, :, :, :have] = self.cache.k
        bigger.v[:, :, :, :have] = self.cache.v
        self.cache = bigger
        for i, r in enumerate(self.rows):
            r.seq.cache = bigger.rows(i, i + 1)


def _pack(trees: list[Tree], starts: torch.Tensor, w: int, kv_len: int | None):
    """Trees -> tokens, positions [B, W] long and mask [B, W, S] bool (S = kv_len; None when kv_len is None:
    exact mode's path attention needs no mask).

    Row b's node i sits at slot starts[b] + i and position starts[b] + depth[i]; it sees
    the row's committed slots and its tree ancestors. Padding nodes see slot 0 only
    (finite, never read).
    """
    b, dev = len(trees), starts.device
    tokens = torch.zeros(b, w, dtype=torch.long, device=dev)
    positions = starts[:, None].repeat(1, w)
    mask = None
    if kv_len is not None:
        mask = torch.zeros(b, w, kv_len, dtype=torch.bool, device=dev)
        mask[:, :, 0] = True
    for i, (t, s) in enumerate(zip(trees, starts.tolist(), strict=True)):
        n = t.num_nodes
        tokens[i, :n] = t.tokens
        positions[i, :n] += t.depth
        if mask is not None:
            mask[i, :n, :s] = True
            mask[i, :n, s : s + n] = t.mask
    return tokens, positions, mask
