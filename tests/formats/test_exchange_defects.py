"""Issue 13's export defects, one test each (2 is in test_speculators_library.py, 1 in test_plain_install.py,
the Medusa CLI half of 7 in test_convert.py).

3. vLLM's EAGLE-1 model builds ``fc`` without a bias and reads config ``bias`` as the attention bias
   (vllm ``models/llama_eagle.py`` 00da923, ``models/llama.py`` 0035bdf ``attention_bias = ... or
   getattr(config, "bias", False)``): the ``vllm`` layout writes neither.
4. ``verifier.architectures`` comes from the target's config, not from the head's Llama layer.
5. ``norm_before_residual`` heads are refused for the layout SGLang / TensorRT-LLM load.
6. A non-Llama (MoE) draft layer is refused while reading the config, with the reason.
7. Medusa's ``base_model_name_or_path`` names the target.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from eyas.drafters.eagle import EagleHead, HeadMismatchError
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head
from eyas.drafters.medusa import medusa_heads_for
from eyas.formats import read_weights, save_tensors
from eyas.formats.convert import ConvertRequest, convert
from eyas.formats.eagle1 import save_eagle1
from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.formats.gguf_eagle3 import load_eagle3_gguf, save_eagle3_gguf
from eyas.models.config import ModelConfig


def _eagle3(cfg: ModelConfig, **flags) -> Eagle3Head:
    torch.manual_seed(0)
    base = Eagle3Config.for_target(cfg, 128, (0, 1, 2))
    return Eagle3Head(replace(base, **flags)).eval().requires_grad_(False)


# ---- 3 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2"])
def test_eagle1_vllm_layout_has_no_fc_bias_and_bias_false(tiny, tmp_path, kind):
    cfg = ModelConfig(**{**tiny.native(kind).config.__dict__, "num_layers": 1})
    head = EagleHead(cfg, bias=True)
    with torch.no_grad():
        head.fc.bias.zero_()  # a zero bias is no bias: it may go
    save_eagle1(head, tmp_path, layout="vllm")
    sd, raw = read_weights(tmp_path), json.loads((tmp_path / "config.json").read_text())
    assert "fc.bias" not in sd and raw["bias"] is False  # vLLM: fc bias=False; config.bias = attention bias
    assert raw["model_type"] == "llama" and raw["architectures"] == ["LlamaForCausalLM"]
    has_bias = kind != "llama"
    # vLLM's LlamaAttention builds q/k/v and o biases from one flag: Qwen2's o_proj gets a zero bias
    assert raw["attention_bias"] is has_bias
    assert ("layers.0.self_attn.o_proj.bias" in sd) is has_bias
    if kind == "qwen2":
        assert not sd["layers.0.self_attn.o_proj.bias"].any()
    with torch.no_grad():
        head.fc.bias.fill_(0.1)
    with pytest.raises(ValueError, match="nonzero bias"):
        save_eagle1(head, tmp_path / "b", layout="vllm")


# ---- 4 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, arch", [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                        ("mistral", "MistralForCausalLM")])
def test_verifier_architectures_are_the_targets(tiny, tmp_path, kind, arch):
    tiny.hf(kind).save_pretrained(tmp_path / "target")
    head = _eagle3(tiny.native(kind).config)
    assert head.cfg.model.model_type == "llama"  # the head's layer is a Llama layer whatever the target
    save_eagle3(head, tmp_path / "head", target_name=str(tmp_path / "target"), speculators=True)
    verifier = json.loads((tmp_path / "head" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == [arch]


# ---- 5 --------------------------------------------------------------------------------------------
def test_norm_before_residual_is_refused_where_engines_ignore_it(tiny, tmp_path):
    target = tiny.native("llama")
    head = _eagle3(target.config, norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual=true, which SGLang and TensorRT-LLM ignore"):
        save_eagle3(head, tmp_path / "e3")
    save_eagle3(head, tmp_path / "spec", speculators=True, dtype=torch.float32)  # vLLM reads the flag
    assert load_eagle3(tmp_path / "spec", target.config).cfg.norm_before_residual
    save_eagle3_gguf(head, tmp_path / "h.gguf")  # llama.cpp reads eagle3.norm_before_residual
    assert load_eagle3_gguf(tmp_path / "h.gguf", target.config).cfg.norm_before_residual
    tiny.hf("llama").save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="norm_before_residual"):
        convert(ConvertRequest(tmp_path / "spec", tmp_path / "out", "eagle3", str(tmp_path / "target")))


# ---- 6 --------------------------------------------------------------------------------------------
def test_moe_draft_layer_is_refused_at_the_config_stage(tiny, tmp_path):
    target = tiny.native("llama")
    save_eagle3(_eagle3(target.config), tmp_path)
    sd = read_weights(tmp_path)
    for k in ("gate_proj", "up_proj", "down_proj"):
        sd[f"midlayer.mlp.experts.0.{k}.weight"] = sd.pop(f"midlayer.mlp.{k}.weight")
    sd["midlayer.mlp.router.weight"] = torch.zeros(4, 64)
    save_tensors(sd, tmp_path / "model.safetensors")
    with pytest.raises(HeadMismatchError, match="mixture of experts.*not supported"):
        load_eagle3(tmp_path, target.config)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss", "mixtral"])
def test_speculators_non_llama_layer_is_refused(tiny, tmp_path, kind):
    target = tiny.native("llama")
    save_eagle3(_eagle3(target.config), tmp_path, speculators=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["transformer_layer_config"]["model_type"] = kind
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadMismatchError, match=f"'{kind}' decoder layer.*not supported"):
        load_eagle3(tmp_path, target.config)


# ---- 7 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_medusa_base_model_for_the_embedded_target(tmp_path, default_target):
    heads = medusa_heads_for(default_target.model, num_heads=2, init="random")
    from eyas.formats.medusa import save_medusa

    save_medusa(heads, tmp_path / "src", layout="vllm", target_name="")  # what eyas train wrote before
    convert(ConvertRequest(tmp_path / "src", tmp_path / "out", "medusa", verifier="embedded"))
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert raw["medusa_num_heads"] == 2 and (tmp_path / "out" / "medusa_lm_head.safetensors").is_file()
