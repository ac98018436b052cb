"""Incremental detokenisation: the one place generated token ids become text.

Every consumer of a token stream uses it: ``Speculator.stream_events`` (the library's stream),
the serving engine (text deltas with stop strings) and the chat page's per-token marks (the
``pieces`` of each chunk).

A token's text is not ``decode([token])``: byte-level BPE splits a multi-byte character over
several tokens (each alone decodes to U+FFFD, the replacement character), and SentencePiece
drops a word's leading space when a token is decoded alone. So a token's *piece* is what
decoding a short window ending at it adds to decoding the window without it, as vLLM's
``detokenize_incrementally`` does. A token that ends inside a character gets ``""`` and the
token that completes it gets the whole character; special tokens (EOS) get ``""``. The pieces
of a response concatenate to ``tokenizer.decode(ids, skip_special_tokens=True)``; at the end
(``finished``) an incomplete trailing character is flushed as decode gives it (U+FFFD).

Each step costs two decodes of a window of a few tokens, not a decode of the whole response.

Stop strings: text that could still grow into one (its last ``max(len(stop)) - 1`` characters)
is held back until it cannot, so a stop string never reaches the client; after one, the text
ends before it and ``stopped`` is set.

    detok = Detokenizer(tokenizer, stop=("User:",))
    d = detok.push([72, 101], finished=False)   # d.text: new text to show; d.pieces: one per token
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class TextDelta:
    """What one ``push`` adds."""

    text: str  # new text that is safe to show (stop strings and incomplete characters held back)
    pieces: list[str]  # each pushed token's own text (see the module docstring), one per token


class Detokenizer:
    """Incremental detokenisation of one response, with optional stop strings."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        # ids[prefix:read] is the context window already turned into pieces; ids[read:] is pending
        self.prefix = self.read = 0
        self.decoded = ""  # concatenation of every piece so far
        self.text = ""  # text released so far (a prefix of ``decoded``, never past a stop string)
        self.stopped = False

    def push(self, ids: Sequence[int], finished: bool = False) -> TextDelta:
        """Add one step's tokens; ``finished``: the last step (release everything, flush the tail)."""
        pieces = [self._piece(t) for t in ids]
        if finished:  # flush an incomplete trailing character, as decode shows it
            tail = self._window_text(self.prefix, len(self.ids))[len(self._window_text(self.prefix, self.read)) :]
            self.prefix = self.read = len(self.ids)
            self.decoded += tail
            if pieces:
                pieces[-1] += tail
        if self.stopped:
            return TextDelta("", pieces)
        return TextDelta(self._release(finished), pieces)

    def _release(self, finished: bool) -> str:
        text = self.decoded
        hits = [i for i in (text.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0]
        if hits:
            text, finished, self.stopped = text[: min(hits)], True, True
        end = len(text) if finished else max(len(self.text), len(text) - self.hold)
        delta = text[len(self.text) : end]
        self.text += delta
        return delta

    def _piece(self, token: int) -> str:
        self.ids.append(token)
        before = self._window_text(self.prefix, self.read)
        after = self._window_text(self.prefix, len(self.ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a special token, or a character still incomplete: a later token carries it
        # Example: window [" the", " cat"] decoded " the cat", before " the" -> piece " cat". The
        # window then starts at the first pending token, so one token of context stays for the next.
        self.prefix, self.read = self.read, len(self.ids)
        piece = after[len(before) :]
        self.decoded += piece
        return piece

    def _window_text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True) if end > start else ""
