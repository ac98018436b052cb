"""The one incremental detokeniser (eyas.detok): per-token pieces, text deltas, stop strings.

The API stream, the serving engine and the chat page's marks all use it (issue 14: there were three).
"""

from __future__ import annotations

import pytest

from eyas.detok import Detokenizer

TEXT = "Héllo wörld 🦅 eyas — 日本語, done.\nNext line."


def test_pieces_concatenate_to_the_decoded_text(default_target):
    tok = default_target.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    d = Detokenizer(tok)
    got = d.push(ids[:5]).pieces + d.push(ids[5:6]).pieces + d.push(ids[6:]).pieces  # any split into steps
    assert len(got) == len(ids)
    assert "".join(got) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert "\ufffd" not in "".join(got)
    assert got[-1] == ""  # EOS: a special token has no text
    # a byte-level token ending inside a character gets "", the one completing it the whole character
    eagle = [i for i, p in enumerate(got) if "🦅" in p]
    assert len(eagle) == 1 and got[eagle[0] - 1] == ""


def test_pieces_of_plain_words_are_single_token_decodes(default_target):
    tok = default_target.tokenizer
    ids = tok.encode(" the quick brown fox", add_special_tokens=False)
    assert Detokenizer(tok).push(ids).pieces == [tok.decode([t]) for t in ids]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_text_deltas_equal_the_full_decode(default_target, step):
    tok = default_target.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = Detokenizer(tok)
    chunks = [d.push(ids[i : i + step], finished=i + step >= len(ids)).text for i in range(0, len(ids), step)]
    assert "".join(chunks) == tok.decode(ids) and "\ufffd" not in "".join(chunks)


def test_incomplete_character_is_flushed_at_the_end(default_target):
    tok = default_target.tokenizer
    ids = tok.encode("a 🦅", add_special_tokens=False)[:-1]  # cut inside the 4-byte character
    d = Detokenizer(tok)
    first = d.push(ids).text
    assert "\ufffd" not in first  # the partial character is held
    assert first + d.push([], finished=True).text == tok.decode(ids)  # then flushed as decode shows it
    d = Detokenizer(tok)
    assert d.push(ids, finished=True).text == tok.decode(ids)  # as decode gives it (U+FFFD)


def test_stop_string_is_never_sent(default_target):
    tok = default_target.tokenizer
    ids = tok.encode("one two three four", add_special_tokens=False)
    d = Detokenizer(tok, stop=("three",))
    out = "".join(d.push([t]).text for t in ids)
    assert out == "one two " and d.stopped and d.text == "one two "
