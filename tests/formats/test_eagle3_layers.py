"""EAGLE-3 heads of more than one decoder layer: eyas runs, writes, reads and grows them.

The first layer is EAGLE-3's (``midlayer``, reading [norm(embedding), norm(hidden)]); later ones are plain Llama
layers, written ``layers.1.*`` .. as vLLM's ``llama_eagle3.py`` names them (it renames ``midlayer.`` to
``layers.0.``), read also from TensorRT-LLM's ``midlayer.{i}.*``. Greedy losslessness with a two-layer head is
in tests/test_lossless.py (``eagle3_2l``).
"""

from __future__ import annotations

import json

import pytest
import torch

from eyas.cli import main
from eyas.drafters.eagle import HeadMismatchError
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from eyas.drafters.head_kernels import HeadPaths
from eyas.formats import read_weights, save_tensors
from eyas.formats.eagle3 import canonical_state_dict, load_eagle3, save_eagle3
from eyas.formats.gguf_eagle3 import save_eagle3_gguf
from eyas.kv.static import KVCache
from eyas.train.eagle3 import add_layers, widen_mlp
from tests.conftest import randomise_norms_and_biases
from tests.formats.test_eagle3_format import VD, assert_same_head, generate, make_head


def two_layer_head(cfg, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(cfg, VD, (0, 1, 2), num_layers=2))
    g = torch.Generator().manual_seed(seed)
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:VD])
    randomise_norms_and_biases(head, g)
    return head.eval().requires_grad_(False)


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))


def test_written_names_and_config(tiny, tmp_path):
    target = tiny.native("llama")
    save_eagle3(two_layer_head(target.config), tmp_path)
    keys = set(read_weights(tmp_path))
    second = {k for k in keys if k.startswith("layers.1.")}
    assert {k.removeprefix("layers.1.") for k in second} == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight"}
    assert read_weights(tmp_path)["layers.1.self_attn.q_proj.weight"].shape == (64, 64)  # H in, not 2H
    assert not any(k.startswith("extra_layers") for k in keys)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize("speculators", (False, True))
def test_round_trip_drafts_the_same(tiny, tmp_path, prompt, speculators):
    target = tiny.native("llama")
    head = two_layer_head(target.config, seed=1)
    save_eagle3(head, tmp_path, dtype=torch.float32, speculators=speculators)
    got = load_eagle3(tmp_path, target.config, torch.float32)
    assert got.cfg.model.num_layers == 2
    assert_same_head(head, got)
    ref = generate(target, None, prompt)[0]
    out_mem, stats_mem, trees_mem = generate(target, head, prompt)
    out, stats, trees = generate(target, got, prompt)
    assert out == out_mem == ref
    assert trees == trees_mem and stats == stats_mem


def test_trt_llm_names_read_and_the_count_checked(tiny, tmp_path):
    target = tiny.native("llama")
    head = two_layer_head(target.config, seed=2)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    sd = read_weights(tmp_path)
    # TensorRT-LLM's multi-layer names: midlayer.0.*, midlayer.1.*
    trt = {k.replace("midlayer.", "midlayer.0.").replace("layers.1.", "midlayer.1."): v for k, v in sd.items()}
    assert canonical_state_dict(trt)[0].keys() == canonical_state_dict(sd)[0].keys()
    save_tensors(trt, tmp_path / "model.safetensors")
    assert_same_head(head, load_eagle3(tmp_path, target.config, torch.float32))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(HeadMismatchError, match="num_hidden_layers 1 but the weights hold 2 decoder layers"):
        load_eagle3(tmp_path, target.config, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    save_tensors({k.replace("midlayer.1.", "midlayer.2."): v for k, v in trt.items()}, tmp_path / "model.safetensors")
    with pytest.raises(HeadMismatchError, match=r"numbered \[2\], not 1 .. 1"):
        load_eagle3(tmp_path, target.config, torch.float32)


def test_gguf_export_refuses_more_than_one_layer(tiny, tmp_path):
    with pytest.raises(ValueError, match="2 decoder layers.*builds one"):
        save_eagle3_gguf(two_layer_head(tiny.native("llama").config), tmp_path / "h.gguf")


def test_fast_path_matches_the_torch_path(tiny):
    """The compiled few-row path (cache layer 1 for the second layer) against torch's ops, same weights."""
    target = tiny.native("llama")
    drafter = Eagle3Drafter(target_model=target, head=two_layer_head(target.config, seed=3), tree="dynamic:4,4,12")
    head = drafter.head
    if not head.fast_ready():
        pytest.skip("no compiled head kernels on this machine")
    c = head.config
    g = torch.Generator().manual_seed(4)
    emb, hid = torch.randn(5, c.hidden_size, generator=g), torch.randn(5, c.hidden_size, generator=g)
    pos = torch.arange(5)
    caches = [KVCache.empty(2, 1, c.num_kv_heads, 64, c.head_dim, torch.float32, "cpu") for _ in range(2)]
    fast = head.fast_forward(emb, hid, pos, caches[0], 0, HeadPaths.causal(0, 5))
    ref = head(emb[None], hid[None], pos[None], caches[1], 0, None)[0]
    assert torch.allclose(fast, ref, atol=0.05 * float(ref.abs().max()), rtol=0)  # int8 activations in the kernel
    assert caches[0].k[1].abs().sum() > 0  # the second layer wrote its own cache layer
    torch.testing.assert_close(caches[0].k[1, 0, :, :5], caches[1].k[1, 0, :, :5], atol=0.05, rtol=0.05)


def test_added_layers_keep_the_function_and_learn(tiny):
    from eyas.train.eagle3 import Eagle3LossConfig, Eagle3Objective
    from eyas.train.features import TargetFeaturizer

    target = tiny.native("llama")
    cfg = target.config
    head = make_head(cfg).train().requires_grad_(True)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    ones = torch.ones(2, 12, dtype=torch.bool)
    batch = TargetFeaturizer(target, head.cfg.aux_layers)(ids, ones, ones)

    def loss(h):
        return Eagle3Objective(h, target, Eagle3LossConfig(ttt_steps=2)).loss(batch)[0]

    before = loss(head).detach()
    grown = add_layers(head, 3, seed=0)
    assert grown.cfg.model.num_layers == 3 and len(grown.extra_layers) == 2 and grown.config.num_layers == 3
    assert all(p.requires_grad for p in grown.parameters())
    after = loss(grown)
    torch.testing.assert_close(after.detach(), before, rtol=0, atol=0)  # zero o_proj and down_proj: the same
    after.backward()
    layer = grown.extra_layers[0]
    assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0
    assert add_layers(grown, 3) is grown
    with pytest.raises(ValueError, match="only adds"):
        add_layers(grown, 2)
    with pytest.raises(ValueError, match="widen it first"):
        widen_mlp(grown, 4 * cfg.intermediate_size)


def test_head_layers_needs_an_init_head(tmp_path, capsys):
    assert main(["train", "--data", "x.jsonl", "--out", str(tmp_path), "--head-layers", "2"]) != 0
    assert "--head-layers adds layers to the head given by --init-head" in capsys.readouterr().err


@pytest.mark.slow
def test_train_adds_a_layer_to_the_init_head(default_target, tmp_path):
    from safetensors.torch import load_file

    from tests.train.test_train_continue import _args, _data

    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    assert main(_args(data, tmp_path / "a", 2)) == 0
    run = _args(data, tmp_path / "b", 2, "--init-head", str(tmp_path / "a" / "head"), "--head-layers", "2")
    assert main(run) == 0
    grown = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert grown["layers.1.self_attn.o_proj.weight"].any()  # trained away from its zero start
    assert json.loads((tmp_path / "b" / "head" / "config.json").read_text())["num_hidden_layers"] == 2
    spec = load_eagle3(tmp_path / "b" / "head_speculators", default_target.model.config)
    assert spec.cfg.model.num_layers == 2
