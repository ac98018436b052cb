"""Per-token text for the web page's acceptance marking.

A token's text is not ``decode([token])``: byte-level BPE splits a multi-byte character over
several tokens (each alone decodes to U+FFFD, the replacement character), and SentencePiece
drops a word's leading space when a token is decoded alone. ``TokenPieces`` decodes
incrementally, as vLLM's ``detokenize_incrementally`` does: a token's piece is what decoding a
short window ending at it adds to decoding the window without it. A token that ends inside a character
gets ``""`` and the token that completes the character gets all of it, so the pieces of a
response concatenate to ``tokenizer.decode(ids, skip_special_tokens=True)`` (a trailing
incomplete character excepted: it never gets a piece).

    pieces = TokenPieces(tokenizer)
    pieces.push([72, 101])      # -> ["He", "llo"]; special tokens (EOS) get ""
"""

from __future__ import annotations


class TokenPieces:
    """Incremental per-token detokenisation of one response (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        # ids[prefix:read] is the context window already turned into pieces; ids[read:] is pending
        self.prefix = self.read = 0

    def push(self, ids: list[int]) -> list[str]:
        """The piece of each token in ``ids``, in order (``""`` while a character is incomplete)."""
        return [self._one(t) for t in ids]

    def _one(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a special token, or a character still incomplete: the next token carries it
        # Example: window [" the", " cat"] decoded " the cat", before " the" -> piece " cat". The
        # window then starts at the first pending token, so one token of context stays for the next.
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]
