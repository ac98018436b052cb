"""--quantize int8: weight-only int8 projections; speculation stays lossless with respect to the int8 model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.ngram import NgramDrafter
from eyas.models.loading import ModelLoadError, load_target
from eyas.models.quant import Int8Linear


def _generate(target, drafter, prompt, exact=False, n=40):
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n, exact=exact))
    return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()], dec


def test_int8_linear_matches_its_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    q = Int8Linear(lin)
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() <= 127
    x = torch.randn(5, 64)
    ref = x @ q.dequantized().T + lin.bias
    assert torch.allclose(q(x), ref, atol=1e-4)
    # the quantization error is bounded by half a step per weight
    assert (q.dequantized() - lin.weight).abs().max() <= q.scales.max() / 2 + 1e-7


@pytest.mark.parametrize("kind", ("llama", "qwen2", "qwen3"))
def test_int8_target_speculation_equals_int8_plain(tiny, kind):
    target = tiny.native(kind, seed=0)
    target.quantize_("int8")
    assert isinstance(target.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(target.lm_head_proj, Int8Linear)
    assert type(target.model.embed_tokens) is nn.Embedding  # the embedding keeps its float table
    prompt = torch.tensor([3, 5, 7, 3, 5, 7, 3, 5, 9, 11] * 3)
    plain, _ = _generate(target, None, prompt)
    spec, dec = _generate(target, NgramDrafter(num_draft=4), prompt)
    assert spec == plain
    assert dec.stats.drafted > 0


def test_int8_bf16_exact_speculation_equals_plain(tiny):
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    target.quantize_("int8")
    prompt = torch.tensor([3, 5, 7, 3, 5, 7, 3, 5, 9, 11] * 3)
    plain, _ = _generate(target, None, prompt, exact=True)
    spec, _ = _generate(target, NgramDrafter(num_draft=4), prompt, exact=True)
    assert spec == plain


def test_int8_changes_the_model(tiny):
    fp = tiny.native("llama", seed=0)
    q = tiny.native("llama", seed=0)
    q.quantize_("int8")
    tokens, pos = torch.arange(12)[None], torch.arange(12)[None]
    a = fp.forward(tokens, pos, fp.new_cache(1, 16), 0).logits
    b = q.forward(tokens, pos, q.new_cache(1, 16), 0).logits
    assert not torch.equal(a, b)
    assert torch.allclose(a, b, atol=0.5)


def test_unknown_quantization_and_hf_backend_are_clear_errors(tmp_path, tiny):
    target = tiny.native("llama", seed=0)
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        target.quantize_("int4")
    with pytest.raises(ModelLoadError, match="needs the native backend"):
        load_target(str(tmp_path), "float32", backend="hf", quantize="int8")
