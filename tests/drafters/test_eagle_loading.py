"""Loading EAGLE-1 heads saved in the reference layout (SafeAILab/EAGLE ``cnets.py``).

A head directory holds ``config.json`` (a LlamaConfig-like dict plus ``bias``)
and ``pytorch_model.bin`` or ``model.safetensors`` with the keys ``fc.weight``,
``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight`` and optionally
``embed_tokens.weight``. Heads load through ``load_eagle_head`` and through
``build_drafter(DrafterSpec(path))``, and decoding with them stays lossless.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.draft_lm import DraftLMDrafter
from eyas.drafters.eagle import EagleDrafter, EagleHead, HeadMismatchError, load_eagle_head, random_head
from eyas.drafters.loading import DrafterLoadError, DrafterSpec, build_drafter, detect_kind
from eyas.models.loading import LoadedTarget
from tests.conftest import randomise_norms_and_biases
from tests.formats.test_eagle1_format import REFERENCE_KEYS  # SafeAILab's EAGLE-1 layout


# ---- helpers ------------------------------------------------------------------------------------
def head_config_json(cfg, bias: bool = True, **overrides) -> dict:
    """The config.json of an EAGLE-1 head for a target with ModelConfig ``cfg``."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bias": bias,
    }
    out.update(overrides)
    return out


def randomise(head: EagleHead, seed: int) -> EagleHead:
    """Non-trivial norms and biases, so a loader that drops them is caught."""
    g = torch.Generator().manual_seed(seed)
    randomise_norms_and_biases(head, g)
    return head


def reference_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under the reference key names, written out explicitly."""
    layer = head.layers[0]
    sd = {"fc.weight": head.fc.weight}
    if head.fc.bias is not None:
        sd["fc.bias"] = head.fc.bias
    for n in ("q", "k", "v", "o"):
        sd[f"layers.0.self_attn.{n}_proj.weight"] = getattr(layer.self_attn, f"{n}_proj").weight
    for n in ("gate", "up", "down"):
        sd[f"layers.0.mlp.{n}_proj.weight"] = getattr(layer.mlp, f"{n}_proj").weight
    sd["layers.0.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    if head.embed_tokens is not None:
        sd["embed_tokens.weight"] = head.embed_tokens.weight
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def save_head(d: Path, sd: dict, config: dict, fmt: str = "bin") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(sd, str(d / "model.safetensors"))
    return d


def generate(target, drafter, prompt: torch.Tensor, n: int = 24):
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n))
    return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()], dec.stats


def loaded(model) -> LoadedTarget:
    return LoadedTarget(model=model, tokenizer=None, path=Path("."), name="tiny")


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.models.loading import native_from_hf_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.08, tie_word_embeddings=False)
    return native_from_hf_model(LlamaForCausalLM(cfg).eval(), torch.float32)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(target, prompt) -> list[int]:
    return generate(target, None, prompt)[0]


# ---- round trips ----------------------------------------------------------------------------------
def test_random_head_has_exactly_the_reference_keys(target):
    assert set(random_head(target.config).state_dict()) == REFERENCE_KEYS
    head = EagleHead(replace(target.config, num_layers=1), with_embedding=True)
    assert set(head.state_dict()) == REFERENCE_KEYS | {"embed_tokens.weight"}


@pytest.mark.parametrize("fmt", ("bin", "safetensors"))
@pytest.mark.parametrize("with_embedding", (False, True), ids=("target-embed", "own-embed"))
def test_load_reference_layout_round_trip(tmp_path, target, prompt, reference, fmt, with_embedding):
    head = randomise(EagleHead(replace(target.config, num_layers=1), with_embedding=with_embedding), seed=1)
    head = head.eval().requires_grad_(False)
    sd = reference_state_dict(head)
    d = save_head(tmp_path / "head", sd, head_config_json(target.config), fmt)

    got = load_eagle_head(d, target.config, torch.float32)
    assert isinstance(got, EagleHead)
    assert (got.embed_tokens is not None) == with_embedding
    got_sd = got.state_dict()
    assert set(got_sd) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got_sd[k], v), k
    assert not any(p.requires_grad for p in got.parameters())

    # decoding with the loaded head is lossless and drafts exactly what the in-memory head drafts
    out, stats = generate(target, EagleDrafter(target_model=target, head=got, tree="dynamic:4,4,12"), prompt)
    assert out == reference
    out_mem, stats_mem = generate(target, EagleDrafter(target_model=target, head=head, tree="dynamic:4,4,12"),
                                  prompt)
    assert out_mem == reference and stats_mem == stats


def test_loaded_head_dtype(tmp_path, target):
    head = random_head(target.config, seed=2)
    d = save_head(tmp_path / "head", reference_state_dict(head), head_config_json(target.config))
    got = load_eagle_head(d, target.config, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())


@pytest.mark.parametrize("fmt", ("bin", "safetensors"))
@pytest.mark.parametrize("tree", (None, "static:eagle_small", "chain:3"))
def test_build_drafter_from_head_directory(tmp_path, target, prompt, reference, fmt, tree):
    head = random_head(target.config, seed=3)
    d = save_head(tmp_path / "head", reference_state_dict(head), head_config_json(target.config), fmt)
    assert detect_kind(d) == "eagle"
    drafter = build_drafter(DrafterSpec(str(d), tree=tree), loaded(target))
    assert isinstance(drafter, EagleDrafter)
    assert generate(target, drafter, prompt)[0] == reference


def test_build_drafter_prefers_safetensors_when_both_exist(tmp_path, target, prompt, reference):
    """Both files present (a converted checkpoint): either is a valid head; decoding stays lossless."""
    head = random_head(target.config, seed=4)
    sd = reference_state_dict(head)
    d = save_head(tmp_path / "head", sd, head_config_json(target.config), "bin")
    save_head(d, sd, head_config_json(target.config), "safetensors")
    drafter = build_drafter(DrafterSpec(str(d)), loaded(target))
    assert isinstance(drafter, EagleDrafter)
    assert generate(target, drafter, prompt)[0] == reference


def test_build_drafter_from_full_lm_directory_is_a_draft_lm(tmp_path, target, prompt, reference):
    """A directory holding a whole causal LM (not fc.* / layers.0.* only) becomes the draft LM drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    assert detect_kind(tmp_path / "lm") == "draft"
    drafter = build_drafter(DrafterSpec(str(tmp_path / "lm")), loaded(target))
    assert isinstance(drafter, DraftLMDrafter)
    assert generate(target, drafter, prompt)[0] == reference


# ---- errors ---------------------------------------------------------------------------------------
def test_hidden_size_mismatch(tmp_path, target):
    small = replace(target.config, hidden_size=32, head_dim=8, intermediate_size=64, num_layers=1)
    head = random_head(small, seed=0)
    d = save_head(tmp_path / "head", reference_state_dict(head), head_config_json(small))
    with pytest.raises(HeadMismatchError, match="hidden size"):
        load_eagle_head(d, target.config, torch.float32)
    with pytest.raises(HeadMismatchError, match="hidden size"):
        build_drafter(DrafterSpec(str(d)), loaded(target))


def test_config_says_bias_but_weights_have_none(tmp_path, target):
    sd = reference_state_dict(random_head(target.config))
    del sd["fc.bias"]
    d = save_head(tmp_path / "head", sd, head_config_json(target.config, bias=True))
    with pytest.raises(HeadMismatchError, match="bias"):
        load_eagle_head(d, target.config, torch.float32)


def test_weights_have_bias_but_config_says_none(tmp_path, target):
    sd = reference_state_dict(random_head(target.config))
    d = save_head(tmp_path / "head", sd, head_config_json(target.config, bias=False))
    with pytest.raises(HeadMismatchError, match="bias"):
        load_eagle_head(d, target.config, torch.float32)


def test_head_without_bias_loads_when_config_agrees(tmp_path, target, prompt, reference):
    head = EagleHead(replace(target.config, num_layers=1), bias=False).eval().requires_grad_(False)
    sd = reference_state_dict(head)
    assert "fc.bias" not in sd
    d = save_head(tmp_path / "head", sd, head_config_json(target.config, bias=False))
    got = load_eagle_head(d, target.config, torch.float32)
    assert got.fc.bias is None
    drafter = EagleDrafter(target_model=target, head=got, tree="chain:4")
    assert generate(target, drafter, prompt)[0] == reference


def test_missing_layer_weight_is_a_mismatch(tmp_path, target):
    sd = reference_state_dict(random_head(target.config))
    del sd["layers.0.mlp.down_proj.weight"]
    d = save_head(tmp_path / "head", sd, head_config_json(target.config))
    with pytest.raises(HeadMismatchError, match="down_proj"):
        load_eagle_head(d, target.config, torch.float32)


def test_config_disagrees_with_weight_shapes(tmp_path, target):
    """config.json's intermediate_size does not match the saved MLP: a clear HeadMismatchError."""
    sd = reference_state_dict(random_head(target.config))
    cfg = head_config_json(target.config, intermediate_size=target.config.intermediate_size * 2)
    d = save_head(tmp_path / "head", sd, cfg)
    with pytest.raises(HeadMismatchError, match="intermediate|mlp|shape|size"):
        load_eagle_head(d, target.config, torch.float32)


def test_not_an_eagle_head(tmp_path, target):
    """Weights without fc.weight are not an EAGLE head."""
    sd = reference_state_dict(random_head(target.config))
    del sd["fc.weight"]
    d = save_head(tmp_path / "head", sd, head_config_json(target.config))
    with pytest.raises(HeadMismatchError, match="fc.weight"):
        load_eagle_head(d, target.config, torch.float32)


def test_directory_without_weights(tmp_path, target):
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(head_config_json(target.config)))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_eagle_head(d, target.config, torch.float32)


def test_build_drafter_directory_without_weights(tmp_path, target):
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(head_config_json(target.config)))
    with pytest.raises((DrafterLoadError, ValueError, FileNotFoundError), match="weights"):
        build_drafter(DrafterSpec(str(d)), loaded(target))


def test_build_drafter_directory_without_config(tmp_path, target):
    d = tmp_path / "head"
    d.mkdir()
    torch.save(reference_state_dict(random_head(target.config)), d / "pytorch_model.bin")
    with pytest.raises(DrafterLoadError, match="config.json"):
        build_drafter(DrafterSpec(str(d)), loaded(target))


def test_build_drafter_missing_path(tmp_path, target):
    with pytest.raises(DrafterLoadError, match="does not exist"):
        build_drafter(DrafterSpec(str(tmp_path / "nope")), loaded(target))


def test_eagle_by_name_without_a_path_is_a_clear_error(target):
    with pytest.raises(ValueError, match="head directory"):
        build_drafter(DrafterSpec("eagle"), loaded(target))


def test_unknown_drafter_name_lists_known(target):
    with pytest.raises(DrafterLoadError, match="ngram") as e:
        build_drafter(DrafterSpec("nosuch"), loaded(target))
    assert "eagle" in str(e.value) and "nosuch" in str(e.value)


def test_bad_tree_spec_for_a_head(tmp_path, target):
    head = random_head(target.config)
    d = save_head(tmp_path / "head", reference_state_dict(head), head_config_json(target.config))
    with pytest.raises(ValueError, match="no parent"):
        build_drafter(DrafterSpec(str(d), tree="static:[[1,2]]"), loaded(target))
    with pytest.raises(ValueError, match="could not read"):
        build_drafter(DrafterSpec(str(d), tree="static:[[0],[0,5"), loaded(target))
    with pytest.raises(ValueError, match="unknown tree"):
        build_drafter(DrafterSpec(str(d), tree="bushy"), loaded(target))
