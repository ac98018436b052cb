"""EAGLE-1 heads written in the SafeAILab reference layout and read back by eyas's loader.

Key names come from SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1 ``Model``: ``fc``,
``layers`` whose layer 0 has no ``input_layernorm``, ``embed_tokens``), and match what
vLLM ``llama_eagle.py`` and SGLang ``llama_eagle.py`` load (both prefix ``model.`` themselves
and replace layer 0's input norm by an identity).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.eagle import EagleDrafter, EagleHead, load_eagle_head
from eyas.drafters.loading import DrafterSpec, build_drafter, detect_kind
from eyas.formats import read_weights
from eyas.formats.eagle1 import save_eagle1
from eyas.models.loading import LoadedTarget
from tests.conftest import randomise_norms_and_biases

# SafeAILab cnets1.py Model / LlamaDecoderLayer(index=0): no layers.0.input_layernorm
REFERENCE_KEYS = {
    "fc.weight",  # Linear(2 * hidden, hidden, bias=config.bias)
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}
# the target family's own extras in the head's decoder layer
EXTRA_KEYS = {
    "llama": set(),
    "llama_bias": {f"layers.0.self_attn.{n}_proj.bias" for n in "qkvo"},  # attention_bias
    "qwen2": {f"layers.0.self_attn.{n}_proj.bias" for n in "qkv"},  # Qwen2 q/k/v bias
    "qwen3": {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"},  # Qwen3 qk-norm
}


def make_head(cfg, bias: bool = True, with_embedding: bool = False, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(replace(cfg, num_layers=1), bias=bias, with_embedding=with_embedding)
    g = torch.Generator().manual_seed(seed)
    randomise_norms_and_biases(head, g)
    return head.eval().requires_grad_(False)


class Recorder:
    """Records every tree an EagleDrafter proposes (duck-typed drafter)."""

    def __init__(self, inner) -> None:
        self.inner, self.taps, self.max_nodes, self.trees = inner, inner.taps, inner.max_nodes, []

    def start(self, max_slots):
        self.inner.start(max_slots)

    def extend(self, tokens, feats):
        self.inner.extend(tokens, feats)

    def propose(self, history, sampling, generator=None):
        out = self.inner.propose(history, sampling, generator)
        self.trees.append((out.tree.tokens.tolist(), out.tree.parents.tolist()))
        return out


def generate(target, head, prompt, n: int = 16):
    rec = (
        Recorder(EagleDrafter(target_model=target, head=head, tree="dynamic:4,4,12"))
        if head is not None
        else None
    )
    dec = SpecDecoder(target, rec, DecodeConfig(max_new_tokens=n))
    return (
        [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()],
        dec.stats,
        (rec.trees if rec else None),
    )


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kind, with_embedding",
    [("llama", False), ("llama", True), ("llama_bias", False), ("qwen2", True), ("qwen3", False)],
)
def test_round_trip_is_identical(tiny, tmp_path, prompt, kind, with_embedding):
    target = tiny.native(kind)
    head = make_head(target.config, with_embedding=with_embedding, seed=1)
    save_eagle1(head, tmp_path, target_name="org/tiny")
    sd = read_weights(tmp_path)
    assert set(sd) == REFERENCE_KEYS | EXTRA_KEYS[kind] | (
        {"embed_tokens.weight"} if with_embedding else set()
    )
    assert sd["fc.weight"].shape == (64, 128) and sd["fc.bias"].shape == (64,)

    got = load_eagle_head(tmp_path, target.config, torch.float32)
    want = head.state_dict()
    assert set(got.state_dict()) == set(want)
    for k, v in got.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(got.inv_freq, head.inv_freq)
    ref = generate(target, None, prompt)[0]
    out_mem, stats_mem, trees_mem = generate(target, head, prompt)
    out, stats, trees = generate(target, got, prompt)
    assert out == out_mem == ref and trees == trees_mem and stats == stats_mem


def test_config_json(tiny, tmp_path):
    """The target's LlamaConfig with one layer plus ``bias`` (SafeAILab ea_model.py reads config.bias)."""
    target = tiny.native("llama")
    save_eagle1(make_head(target.config), tmp_path, target_name="org/tiny")
    cfg = json.loads((tmp_path / "config.json").read_text())
    # vLLM configs/eagle.py maps LlamaForCausalLM -> EagleLlamaForCausalLM
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    # no `bias` key: SafeAILab defaults it to an fc bias, while SGLang's and vLLM's LlamaDecoderLayer
    # read it as the attention bias (sglang models/llama.py 0023954, vllm models/llama.py 0035bdf)
    assert cfg["num_hidden_layers"] == 1 and "bias" not in cfg
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert (
            cfg[key]
            == {
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "max_position_embeddings": 512,
            }[key]
        ), key
    assert cfg["torch_dtype"] == "float32" and cfg["eyas_target"] == "org/tiny"


def test_head_without_fc_bias(tiny, tmp_path, prompt):
    """A head without fc bias gets a zero fc.bias here (SGLang's fc always has one) and none in vLLM's layout."""
    target = tiny.native("llama")
    head = make_head(target.config, bias=False)
    save_eagle1(head, tmp_path / "a")
    assert not read_weights(tmp_path / "a")["fc.bias"].any()
    got = load_eagle_head(tmp_path / "a", target.config, torch.float32)
    assert generate(target, got, prompt) == generate(target, head, prompt)
    save_eagle1(head, tmp_path / "b", layout="vllm")
    assert "fc.bias" not in read_weights(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["bias"] is False
    got = load_eagle_head(tmp_path / "b", target.config, torch.float32)
    assert got.fc.bias is None and generate(target, got, prompt) == generate(target, head, prompt)


def test_dtype_cast_and_loader_detection(tiny, tmp_path, prompt):
    target = tiny.native("llama")
    save_eagle1(make_head(target.config), tmp_path, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in read_weights(tmp_path).values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert detect_kind(tmp_path) == "eagle"
    loaded = LoadedTarget(model=target, tokenizer=None, path=tmp_path, name="tiny")
    drafter = build_drafter(DrafterSpec(str(tmp_path), tree="chain:3"), loaded)
    assert isinstance(drafter, EagleDrafter)
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=12))
    assert [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()] == generate(
        target, None, prompt, 12
    )[0]
