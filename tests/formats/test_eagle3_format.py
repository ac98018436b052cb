"""EAGLE-3 heads written in the layout vLLM, SGLang and TensorRT-LLM load, and read back.

Every expectation on key names, shapes, dtypes and config keys names the engine
file it comes from (see also the docstring of ``eyas.formats.eagle3``). Round trips
must give identical parameters, identical draft trees and identical greedy output.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.base import Drafter
from eyas.drafters.eagle import HeadMismatchError, random_head
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from eyas.formats import read_weights, save_tensors, weight_keys, write_json
from eyas.formats.eagle1 import save_eagle1
from eyas.formats.eagle3 import aux_layers_from_config, load_eagle3, looks_like_eagle3_dir, save_eagle3
from eyas.models.config import ModelConfig
from tests.conftest import randomise_norms_and_biases

VD = 128  # draft vocabulary of the test heads (the tiny targets have 256 tokens)

# The weights an engine expects, with shapes for H = 64, 4 heads, 2 KV heads, head_dim 16.
#   midlayer.* + fc/norm/lm_head/d2t/t2d: SGLang llama_eagle3.py (module names self.midlayer,
#     self.fc, self.norm, lm_head; d2t read as hot_token_id = d2t + arange; t2d skipped),
#   vLLM llama_eagle3.py load_weights (midlayer. -> layers.0., d2t -> draft_id_to_target_id),
#   TRT-LLM modeling_speculative.py Eagle3DraftModel (midlayer, hidden_norm, d2t).
#   q/k/v read 2H: vLLM/SGLang QKVParallelLinear(2 * hidden_size, ...), TRT Eagle3Attention.
EXPECTED = {
    "fc.weight": (64, 3 * 64),  # ReplicatedLinear(target_hidden_size * 3, hidden_size), bias=False (vLLM)
    "midlayer.self_attn.q_proj.weight": (4 * 16, 2 * 64),
    "midlayer.self_attn.k_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.v_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.o_proj.weight": (64, 4 * 16),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "midlayer.input_layernorm.weight": (64,),  # normalises the token embedding
    "midlayer.hidden_norm.weight": (64,),  # normalises the fused hidden state
    "midlayer.post_attention_layernorm.weight": (64,),
    "norm.weight": (64,),
    "lm_head.weight": (VD, 64),  # ParallelLMHead(draft_vocab_size, hidden_size) (vLLM, SGLang)
    "d2t": (VD,),  # int64 offsets: SafeAILab cnets.py register_buffer("d2t", long)
    "t2d": (256,),  # bool over the target vocabulary: SafeAILab cnets.py
}


# ---- helpers ------------------------------------------------------------------------------------
def make_head(cfg: ModelConfig, aux=(0, 1, 2), vd: int = VD, seed: int = 0) -> Eagle3Head:
    """A random head with non-trivial norms and a random sorted draft vocabulary."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(cfg, vd, aux))
    g = torch.Generator().manual_seed(seed)
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:vd])
    randomise_norms_and_biases(head, g)
    return head.eval().requires_grad_(False)


class Recorder(Drafter):
    """Wraps a drafter and records every tree it proposes."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.taps, self.max_nodes, self.trees = inner, inner.taps, inner.max_nodes, []

    def start(self, max_slots: int) -> None:
        self.inner.start(max_slots)

    def extend(self, tokens, feats) -> None:
        self.inner.extend(tokens, feats)

    def propose(self, history, sampling, generator=None):
        out = self.inner.propose(history, sampling, generator)
        self.trees.append((out.tree.tokens.tolist(), out.tree.parents.tolist()))
        return out


def generate(target, head, prompt, tree: str = "dynamic:4,4,12", n: int = 16):
    """(tokens, stats, draft trees) of greedy speculative decoding with an EAGLE-3 head."""
    rec = Recorder(Eagle3Drafter(target_model=target, head=head, tree=tree)) if head is not None else None
    dec = SpecDecoder(target, rec, DecodeConfig(max_new_tokens=n))
    tokens = [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()]
    return tokens, dec.stats, (rec.trees if rec else None)


def assert_same_head(a: Eagle3Head, b: Eagle3Head) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.cfg.aux_layers == b.cfg.aux_layers
    assert torch.equal(a.inv_freq, b.inv_freq)


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))


# ---- the written layout -------------------------------------------------------------------------
def test_written_keys_shapes_and_dtypes(tiny, tmp_path):
    head = make_head(tiny.native("llama").config)
    save_eagle3(head, tmp_path)  # default dtype bfloat16 (what the engines serve)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    sd = read_weights(tmp_path)
    assert {k: tuple(v.shape) for k, v in sd.items()} == EXPECTED  # no embed_tokens: shared with the target
    for k, v in sd.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16)
        assert v.dtype == want, k
    # d2t holds offsets: target id = draft id + d2t (vLLM compute_logits, SGLang hot_token_id)
    assert torch.equal(torch.arange(VD) + sd["d2t"], head.draft_ids())
    assert sd["t2d"].sum() == VD and sd["t2d"][head.draft_ids()].all()


def test_config_json_has_the_keys_the_engines_read(tiny, tmp_path):
    target = tiny.native("llama")
    save_eagle3(make_head(target.config), tmp_path, target_name="org/tiny-llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # vLLM registry, SGLang EntryClass
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 256 and cfg["draft_vocab_size"] == VD  # vLLM compute_logits / lm_head
    assert cfg["target_hidden_size"] == 64  # fc input = 3 * target_hidden_size (vLLM, SGLang, TRT-LLM)
    assert cfg["tie_word_embeddings"] is False  # SGLang ties lm_head to embed_tokens otherwise
    assert cfg["bias"] is False and cfg["attention_bias"] is False  # fc / o_proj / qkv biases (all three)
    assert cfg["norm_before_residual"] is False  # vLLM llama_eagle3.py: residual is the raw hidden input
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert key in cfg, key
    assert cfg["torch_dtype"] == "bfloat16"
    # vLLM get_eagle3_aux_layers_from_config: top-level ids, id i = residual entering layer i
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    # SGLang model_runner reads eagle_config and captures before layer id + 1
    assert cfg["eagle_config"] == {
        "use_aux_hidden_state": True,
        "eagle_aux_hidden_state_layer_ids": [-1, 0, 1],
    }
    assert cfg["eyas_target"] == "org/tiny-llama"
    # both engines parse config.json through transformers (AutoConfig -> LlamaConfig)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "LlamaConfig"
    assert hf.draft_vocab_size == VD and hf.eagle_config["use_aux_hidden_state"] is True
    assert list(hf.eagle_aux_hidden_state_layer_ids) == [0, 1, 2]


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ("llama", "llama3_rope", "llama_bias", "mistral"))
def test_round_trip_is_identical(tiny, tmp_path, prompt, kind):
    target = tiny.native(kind)
    head = make_head(target.config, seed=1)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    got = load_eagle3(tmp_path, target.config, torch.float32)
    assert_same_head(head, got)
    assert not got.training and not any(p.requires_grad for p in got.parameters())
    ref = generate(target, None, prompt)[0]
    out_mem, stats_mem, trees_mem = generate(target, head, prompt)
    out, stats, trees = generate(target, got, prompt)
    assert out == out_mem == ref  # lossless, and the same tokens either way
    assert trees == trees_mem and stats == stats_mem  # identical drafts, step by step


def test_unsorted_taps_are_written_in_engine_order(tiny, tmp_path, prompt):
    """Engines concatenate aux features by ascending layer; fc's column blocks follow."""
    target = tiny.native("llama")
    head = make_head(target.config, aux=(2, 0, 1), seed=2)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    got = load_eagle3(tmp_path, target.config, torch.float32)
    assert got.cfg.aux_layers == (0, 1, 2)
    blocks = head.fc.weight.view(64, 3, 64)
    assert torch.equal(got.fc.weight.view(64, 3, 64), blocks[:, [1, 2, 0]])
    assert (
        generate(target, got, prompt, tree="chain:4")[1:]
        == generate(target, head, prompt, tree="chain:4")[1:]
    )


def test_bfloat16_file_loads_in_the_target_dtype(tiny, tmp_path):
    target = tiny.native("llama")
    head = make_head(target.config)
    save_eagle3(head, tmp_path)
    got = load_eagle3(tmp_path, target.config, torch.float32)
    assert all(p.dtype == torch.float32 for p in got.parameters())
    assert torch.equal(got.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert load_eagle3(tmp_path, target.config, torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_drafter_loads_a_head_directory(tiny, tmp_path, prompt):
    target = tiny.native("llama")
    head = make_head(target.config, seed=4)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    drafter = Eagle3Drafter(target_model=target, path=tmp_path, tree="chain:3")
    assert drafter.taps == (0, 1, 2)
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=12))
    assert [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()] == generate(
        target, None, prompt, n=12
    )[0]


# ---- other trainers' and engines' key names -----------------------------------------------------
def _rename(d: Path, fn, fmt: str = "safetensors", config=None) -> None:
    sd = {fn(k): v for k, v in read_weights(d).items()}
    (d / "model.safetensors").unlink()
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    else:
        save_tensors(sd, d / "model.safetensors")
    if config is not None:
        write_json(d / "config.json", config(json.loads((d / "config.json").read_text())))


def _safeailab_config(cfg: dict) -> dict:
    """A SafeAILab/SpecForge-style config.json: no aux ids at all (engines use their default)."""
    return {k: v for k, v in cfg.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")}


def _sglang_only_config(cfg: dict) -> dict:
    out = dict(cfg)
    del out["eagle_aux_hidden_state_layer_ids"]
    return out


VARIANTS = {
    # speculators / TRT-LLM single-layer naming (vLLM llama_eagle3.py and TRT-LLM read it too)
    "layers.0": (lambda k: k.replace("midlayer.", "layers.0."), "safetensors", None),
    # a state dict saved with the engine's model. prefix
    "model-prefix": (lambda k: k if k == "lm_head.weight" else "model." + k, "safetensors", None),
    # SafeAILab EAGLE-3 release: pytorch_model.bin + an embed_tokens copy, no aux ids (default taps)
    "safeailab-bin": (lambda k: k, "bin", _safeailab_config),
    # SpecForge/SGLang: aux ids only under eagle_config, one lower
    "sglang-ids": (lambda k: k, "safetensors", _sglang_only_config),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_reads_other_layouts(tiny, tmp_path, variant):
    target = tiny.native("llama", num_hidden_layers=7)  # default taps (2, 3, 4), as SafeAILab's configs imply
    head = make_head(target.config, aux=(2, 3, 4), seed=5)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    fn, fmt, config = VARIANTS[variant]
    if variant == "safeailab-bin":
        embed = target.model.embed_tokens.weight.detach()
        sd = {**read_weights(tmp_path), "embed_tokens.weight": embed}
        save_tensors(sd, tmp_path / "model.safetensors")
    _rename(tmp_path, fn, fmt, config)
    assert looks_like_eagle3_dir(tmp_path)
    assert_same_head(head, load_eagle3(tmp_path, target.config, torch.float32))


def test_aux_layer_conventions():
    cfg32 = ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=32, num_heads=2, num_kv_heads=1
    )
    # vLLM top-level ids are used as they are, and win over eagle_config
    assert aux_layers_from_config(
        {
            "eagle_aux_hidden_state_layer_ids": [29, 2, 16],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [9, 9, 9]},
        },
        cfg32,
    ) == (2, 16, 29)
    # SGLang/SpecForge ids starting at 1 are one lower (sglang models/llama.py: layers_to_capture = id + 1)
    assert aux_layers_from_config(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, cfg32
    ) == (2, 16, 29)
    # ... and since sgl-project/sglang#25454 ids not starting at 1 are taken as they are
    assert aux_layers_from_config(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}, cfg32
    ) == (2, 16, 29)
    # none given: the engines' default (2, L // 2, L - 3)
    assert aux_layers_from_config({}, cfg32) == (2, 16, 29)


# ---- speculators --------------------------------------------------------------------------------
def test_speculators_layout(tiny, tmp_path):
    target = tiny.native("llama")
    tiny.hf("llama").save_pretrained(tmp_path / "target")  # the verifier: a local model directory
    head = make_head(target.config, seed=6)
    save_eagle3(head, tmp_path, target_name=str(tmp_path / "target"), dtype=torch.float32, speculators=True)
    keys = weight_keys(tmp_path)
    # speculators Eagle3DraftModel keeps its layer in self.layers (models/eagle3/core.py)
    assert keys == {k.replace("midlayer.", "layers.0.") for k in EXPECTED}
    cfg = json.loads((tmp_path / "config.json").read_text())
    # speculators config.py / models/eagle3/config.py; vLLM configs/speculators/{base,algos}.py
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1  # vLLM: num_speculative_tokens
    # speculators' from_pretrained reads verifier.name_or_path with AutoConfig: an absolute directory here
    want = {"name_or_path": str((tmp_path / "target").resolve()), "architectures": ["LlamaForCausalLM"]}
    assert spec["verifier"] == want
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == 256 and layer["hidden_size"] == 64 and layer["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    # vLLM update_eagle3 defaults norm_before_residual to True when the key is absent
    assert cfg["norm_before_residual"] is False
    assert looks_like_eagle3_dir(tmp_path)
    assert_same_head(head, load_eagle3(tmp_path, target.config, torch.float32))


def test_speculators_config_without_norm_before_residual_means_true(tiny, tmp_path):
    target = tiny.native("llama")
    save_eagle3(make_head(target.config), tmp_path, speculators=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM's speculators adapter reads a missing key as true
    write_json(tmp_path / "config.json", cfg)
    head = load_eagle3(tmp_path, target.config, torch.float32)
    assert head.cfg.norm_before_residual and head.midlayer.norm_before_residual
    # and the flag changes the layer: residual = hidden_norm(hidden), not the raw hidden
    hid, attn = torch.randn(1, 3, target.config.hidden_size) * 5, torch.zeros(1, 3, target.config.hidden_size)
    plain = load_eagle3(tmp_path, target.config, torch.float32)
    plain.midlayer.norm_before_residual = False
    assert not torch.allclose(head.midlayer.finish(hid, attn), plain.midlayer.finish(hid, attn))


# ---- detection ----------------------------------------------------------------------------------
def test_looks_like_eagle3_dir(tiny, tmp_path):
    cfg = tiny.native("llama").config
    save_eagle3(make_head(cfg), tmp_path / "e3")
    save_eagle1(random_head(cfg), tmp_path / "e1")
    (tmp_path / "empty").mkdir()
    assert looks_like_eagle3_dir(tmp_path / "e3")
    assert not looks_like_eagle3_dir(tmp_path / "e1")
    assert not looks_like_eagle3_dir(tmp_path / "empty")


# ---- mismatches ---------------------------------------------------------------------------------
def _saved_for(tiny, tmp_path, **overrides) -> Path:
    save_eagle3(make_head(tiny.native("llama", **overrides).config, aux=(0, 1, 2)), tmp_path / "head")
    return tmp_path / "head"


def test_head_for_another_hidden_size(tiny, tmp_path):
    d = _saved_for(tiny, tmp_path, hidden_size=32, head_dim=8, intermediate_size=64)
    with pytest.raises(HeadMismatchError, match="hidden size 32.*target's hidden size is 64"):
        load_eagle3(d, tiny.native("llama").config, torch.float32)


def test_head_for_another_vocabulary(tiny, tmp_path):
    d = _saved_for(tiny, tmp_path, vocab_size=200)
    with pytest.raises(HeadMismatchError, match="vocabulary of 200 tokens.*target has 256"):
        load_eagle3(d, tiny.native("llama").config, torch.float32)


def test_head_for_a_deeper_target(tiny, tmp_path):
    deep = tiny.native("llama", num_hidden_layers=8).config
    save_eagle3(make_head(deep, aux=(2, 4, 5)), tmp_path)
    with pytest.raises(HeadMismatchError, match=r"layers \[2, 4, 5\].*target has 3 layers"):
        load_eagle3(tmp_path, tiny.native("llama").config, torch.float32)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [0, 1]}, "lists 2 aux layers"),
        (lambda c: {**c, "num_hidden_layers": 2}, "num_hidden_layers 2 but the weights hold 1 decoder layer"),
        (lambda c: {**c, "eagle_config": {**c["eagle_config"], "norm_before_fc": True}}, "norm_before_fc"),
        (lambda c: {**c, "draft_vocab_size": 100}, "draft_vocab_size=100"),
        (lambda c: {**c, "intermediate_size": 256}, "does not match the weights"),
    ],
)
def test_config_problems_are_named(tiny, tmp_path, edit, match):
    target = tiny.native("llama")
    save_eagle3(make_head(target.config), tmp_path)
    write_json(tmp_path / "config.json", edit(json.loads((tmp_path / "config.json").read_text())))
    with pytest.raises(HeadMismatchError, match=match):
        load_eagle3(tmp_path, target.config, torch.float32)


@pytest.mark.parametrize(
    "drop, match",
    [
        ("midlayer.hidden_norm.weight", "hidden_norm"),
        ("fc.weight", "not an EAGLE-3 head"),
        ("lm_head.weight", "no lm_head"),
    ],
)
def test_missing_weights_are_named(tiny, tmp_path, drop, match):
    target = tiny.native("llama")
    save_eagle3(make_head(target.config), tmp_path)
    sd = read_weights(tmp_path)
    del sd[drop]
    save_tensors(sd, tmp_path / "model.safetensors")
    with pytest.raises(HeadMismatchError, match=match):
        load_eagle3(tmp_path, target.config, torch.float32)


@pytest.mark.parametrize("kind, flag, match", [("qwen3", "qk_norm", "q_norm"), ("qwen2", "qkv_bias", "attention_bias")])
def test_heads_the_engines_cannot_express_are_refused(tiny, tmp_path, kind, flag, match):
    """Every engine's EAGLE-3 layer is a plain Llama layer: for_target builds one for Qwen targets too,
    and a head forced to carry Qwen flags is refused on export."""
    head = make_head(tiny.native(kind).config)
    assert not head.cfg.model.qk_norm and not head.cfg.model.qkv_bias
    save_eagle3(head, tmp_path / "ok")  # a head for a Qwen target exports fine
    bad = Eagle3Head(replace(head.cfg, model=replace(head.cfg.model, **{flag: True})))
    with pytest.raises(ValueError, match=match):
        save_eagle3(bad, tmp_path / "bad")
