"""Request settings: typed once at parsing (``RequestSettings``) and carried unchanged to the decoder."""

from __future__ import annotations

import pytest

from eyas.serving.protocol import ChatRequest, TritonRequest, parse
from eyas.types import RequestSettings, SamplingParams


def test_parsed_request_becomes_typed_settings():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.5, "top_k": -1,' \
           b' "top_p": 0.9, "seed": 7, "stop": "END", "speculate": false}'
    s = parse(ChatRequest, body).settings(12)
    assert s == RequestSettings(12, SamplingParams(temperature=0.5, top_k=0, top_p=0.9), 7, False, ("END",))


def test_triton_top_level_and_parameters_merge():
    req = parse(TritonRequest, b'{"text_input": "x", "stop_words": ["a", "b"], "seed": 3, "parameters": {"seed": 4}}')
    s = req.merged().settings(5)
    assert (s.seed, s.stop, s.speculate, s.sampling.greedy) == (4, ("a", "b"), True, True)


@pytest.mark.parametrize(
    "kw, word",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
     ({"stop": ("ok", "")}, "stop")],
)
def test_settings_validate_themselves(kw, word):
    with pytest.raises(ValueError, match=word):
        RequestSettings(**kw)


def test_decoder_from_settings_equals_decoder_from_keywords(default_target):
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    spec = Speculator(default_target, DrafterSpec("ngram"))
    typed = spec.decoder(settings=RequestSettings(9, SamplingParams(0.7, 5, 0.8), 11, speculate=False))
    plain = spec.decoder(speculate=False, max_new_tokens=9, temperature=0.7, top_k=5, top_p=0.8, seed=11)
    assert typed.cfg == plain.cfg and typed.drafter is None is plain.drafter
