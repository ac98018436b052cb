"""Reusing a prompt's prefill across requests (automatic prefix caching).

A prompt's prefill leaves its keys/values and the target features its drafter reads. A later prompt that starts
with the same tokens copies them instead of recomputing them and prefills only the rest: a system prompt shared
by every request, and in a multi-turn chat every earlier turn (turn n's prompt begins with turn n - 1's).

Reuse never changes a token. It runs only in exact mode, where a prompt's cache bits do not depend on how its
prefill was chunked so long as chunks start on multiples of ``quantum`` (eyas.decode.PREFILL_QUANTUM;
tests/test_prefill.py), so a hit is cut down to such a multiple and the rest is prefilled as usual. Only what
prefill computed is kept, never a decoding step's keys: where prefill runs on oneDNN those differ from prefill's in
the last bits (measured on the embedded default in bf16 exact mode, from the first generated position on), so in a
chat the last answer and the new message are prefilled again; everything before them is reused. (Where bf16 prefill
reads the GGUF blocks, eyas.models.gguf_tuning.prefill_on_blocks, a decoding step's keys and values are a fresh
prefill's bits, scripts/decode_kv_check.py, so answers could be kept too: not done yet, the drafter's features for
decoded tokens would have to be recorded at commit.)

The store holds whole prompts (tokens, keys/values, features), least recently used evicted first, within
``max_bytes``. A prompt that extends a stored one replaces it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from eyas.kv.static import KVCache


@dataclass
class PrefixCacheConfig:
    max_bytes: int = 256 << 20  # keys/values and features of every stored prompt together
    quantum: int = 8  # a hit's length is a multiple of this (eyas.decode.PREFILL_QUANTUM)


@dataclass
class PrefixEntry:
    """One prefilled prompt."""

    tokens: torch.Tensor  # [L] long
    k: torch.Tensor  # [Lyr, 1, Hk, L, Dh], the cache's dtype
    v: torch.Tensor  # [Lyr, 1, Hk, L, Dh]
    hidden: torch.Tensor | None  # [L, D] the target's features at prompt rows 0 .. L - 1 (None: no drafter ran)
    taps: dict[int, torch.Tensor]  # layer -> [L, D]

    @property
    def nbytes(self) -> int:
        tensors = [self.tokens, self.k, self.v, *self.taps.values(), *([] if self.hidden is None else [self.hidden])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def serves(self, dtype: torch.dtype, taps: tuple[int, ...] | None) -> bool:
        """Whether a decoder with this cache dtype and these taps (None: no drafter) can take this entry."""
        if self.k.dtype != dtype:
            return False
        return taps is None or self.hidden is not None and all(t in self.taps for t in taps)


@dataclass
class PrefixHit:
    """The first ``length`` prompt tokens are in ``entry``."""

    length: int
    entry: PrefixEntry

    def copy_into(self, cache: KVCache) -> None:
        """Write the hit's keys/values into slots 0 .. length of ``cache``'s row 0."""
        n = self.length
        cache.k[:, :1, :, :n] = self.entry.k[:, :, :, :n]
        cache.v[:, :1, :, :n] = self.entry.v[:, :, :, :n]

    def features(self, taps: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """([length, D] hidden, layer -> [length, D] for each of ``taps``) at prompt rows 0 .. length - 1."""
        n, e = self.length, self.entry
        assert e.hidden is not None
        return e.hidden[:n], {k: e.taps[k][:n] for k in taps}


@dataclass
class PromptRecord:
    """What a prefill computes for the store, chunk by chunk: the target's features at the prompt's rows (copies: a
    forward's outputs may be views of buffers the next forward reuses). A plain decoder records none.
    """

    hidden: list[torch.Tensor] = field(default_factory=list)  # [n_i, D] a chunk
    taps: list[dict[int, torch.Tensor]] = field(default_factory=list)  # layer -> [n_i, D] a chunk

    def add(self, hidden: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self.hidden.append(hidden.clone())
        self.taps.append({k: v.clone() for k, v in taps.items()})

    def nbytes(self, t: int, cache: KVCache) -> int:
        """The size of ``entry``'s result for a ``t``-token prompt, before copying anything."""
        kv = 2 * cache.k[:, :1, :, :t].numel() * cache.k.element_size()
        feats = sum(h.numel() * h.element_size() for h in self.hidden)
        return kv + feats + sum(v.numel() * v.element_size() for part in self.taps for v in part.values()) + 8 * t

    def entry(self, prompt: torch.Tensor, cache: KVCache) -> PrefixEntry:
        """The prompt ([T] long), its cache slots 0 .. T (row 0: views, ``PrefixStore.insert`` copies what it
        keeps) and the recorded features.
        """
        t = prompt.shape[0]
        k, v = cache.k[:, :1, :, :t], cache.v[:, :1, :, :t]
        if not self.hidden:
            return PrefixEntry(prompt.cpu().clone(), k, v, None, {})
        taps = {layer: torch.cat([part[layer] for part in self.taps]) for layer in self.taps[0]}
        return PrefixEntry(prompt.cpu().clone(), k, v, torch.cat(self.hidden), taps)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two [n] long tensors."""
    n = min(a.shape[0], b.shape[0])
    same = (a[:n] == b[:n]).to(torch.int32)
    return int(same.cumprod(0).sum())


class PrefixStore:
    """Stored prompts of one target, shared by its decoders (any thread)."""

    def __init__(self, cfg: PrefixCacheConfig | None = None) -> None:
        self.cfg = cfg or PrefixCacheConfig()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, reused

    @classmethod
    def sized(cls, mb: int) -> PrefixStore | None:
        """A store of ``mb`` MiB, or None (no prefix cache) for 0."""
        return cls(PrefixCacheConfig(max_bytes=mb << 20)) if mb > 0 else None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: torch.Tensor, dtype: torch.dtype, taps: tuple[int, ...] | None) -> PrefixHit | None:
        """The longest usable stored prefix of ``prompt`` ([T] long), or None.

        Usable: at most T - 1 tokens (the last is always prefilled: its logits give the first token), a multiple
        of ``quantum``, from an entry in ``dtype`` holding ``taps`` (None: the decoder has no drafter).
        """
        t, q, prompt = prompt.shape[0], self.cfg.quantum, prompt.cpu()
        with self._lock:
            self.queried_tokens += t
            best, key = 0, None
            for k, e in self._entries.items():
                if e.serves(dtype, taps):
                    n = min(common_prefix(e.tokens, prompt), t - 1) // q * q
                    if n > best:
                        best, key = n, k
            if key is None:
                return None
            self._entries.move_to_end(key)
            self.hit_tokens += best
            return PrefixHit(best, self._entries[key])

    def keep(self, prompt: torch.Tensor, cache: KVCache, record: PromptRecord) -> None:
        """Store a prefilled prompt ([T] long; its keys/values in ``cache``'s row 0, its features in ``record``),
        unless it alone is larger than the store (then nothing is copied).
        """
        if record.nbytes(prompt.shape[0], cache) <= self.cfg.max_bytes:
            self.insert(record.entry(prompt, cache))

    def insert(self, entry: PrefixEntry) -> None:
        """Keep a copy of ``entry``'s keys/values and the rest of it as given (its tokens and features become the
        store's); drop the stored prompts it extends. A prompt a stored one already holds copies nothing.
        """
        if entry.nbytes > self.cfg.max_bytes:
            return
        with self._lock:
            for k, e in list(self._entries.items()):
                n = common_prefix(e.tokens, entry.tokens)
                if n == entry.tokens.shape[0] and _covers(e, entry):  # a stored prompt already holds it
                    self._entries.move_to_end(k)
                    return
                if n == e.tokens.shape[0] and _covers(entry, e):  # entry extends a stored prompt: replace it
                    del self._entries[k]
            self._entries[self._next] = PrefixEntry(entry.tokens, entry.k.clone(), entry.v.clone(), entry.hidden,
                                                    entry.taps)
            self._next += 1
            while self.nbytes > self.cfg.max_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _covers(a: PrefixEntry, b: PrefixEntry) -> bool:
    """Whether ``a`` serves every decoder ``b`` serves (same dtype, features no poorer), over a's own length."""
    return a.k.dtype == b.k.dtype and (b.hidden is None or a.hidden is not None and set(b.taps) <= set(a.taps))
