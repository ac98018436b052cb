"""Per-token pieces for the page's marking: they concatenate to the decoded text, UTF-8 splits included."""

from __future__ import annotations

from eyas.serving.pieces import TokenPieces

TEXT = "Héllo wörld 🦅 eyas — 日本語, done.\nNext line."


def test_pieces_concatenate_to_the_decoded_text(default_target):
    tok = default_target.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    pieces = TokenPieces(tok)
    got = pieces.push(ids[:5]) + pieces.push(ids[5:6]) + pieces.push(ids[6:])  # any split into steps
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
    assert TokenPieces(tok).push(ids) == [tok.decode([t]) for t in ids]
