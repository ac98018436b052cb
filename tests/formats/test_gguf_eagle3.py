"""EAGLE-3 heads as llama.cpp GGUF drafts: keys, tensor names, shapes and types as llama.cpp's eagle3
loader reads them (llama-cpp-python 0.3.36's vendor/llama.cpp 0c1e570: src/models/eagle3.cpp,
src/llama-arch.cpp, conversion/llama.py), q/k rows in GGML's RoPE order, and exact round trips.

scripts/llamacpp_eagle3.sh checks the same file against llama.cpp's own converter (bit-identical)
and runs it in llama.cpp; this file needs no llama.cpp.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head
from eyas.formats.gguf_eagle3 import load_eagle3_gguf, permute_rows, save_eagle3_gguf, unpermute_rows

VD = 96


def head_for(cfg, aux=(0, 1, 2), seed: int = 0) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(cfg, VD, aux))
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:VD])
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    return head.eval().requires_grad_(False)


def test_keys_and_tensors_llama_cpp_reads(tiny, tmp_path):
    head = head_for(tiny.native("llama").config, aux=(2, 0, 1))
    r = GGUFReader(str(save_eagle3_gguf(head, tmp_path / "h.gguf", dtype=torch.bfloat16)))
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.architecture"] == "eagle3"  # LLM_ARCH_EAGLE3
    # eagle3.cpp load_arch_hparams: exactly 3 target layers (ascending), target hidden size, flags
    assert kv["eagle3.target_layers"] == [0, 1, 2] and kv["eagle3.target_hidden_size"] == 64
    assert kv["eagle3.norm_before_residual"] is False and kv["eagle3.norm_before_fc"] is False
    assert kv["eagle3.block_count"] == 1 and kv["eagle3.embedding_length"] == 64
    assert kv["eagle3.attention.head_count"] == 4 and kv["eagle3.attention.head_count_kv"] == 2
    assert kv["eagle3.attention.key_length"] == 16 and kv["eagle3.rope.dimension_count"] == 16
    assert kv["eagle3.feed_forward_length"] == 128 and kv["eagle3.vocab_size"] == 256
    assert kv["general.file_type"] == 32  # LLAMA_FTYPE_MOSTLY_BF16
    # load_arch_tensors: ggml shapes (reversed torch shapes), no token_embd, no biases
    want = {
        "fc.weight": ([192, 64], "BF16"), "output_norm.weight": ([64], "F32"), "output.weight": ([64, VD], "BF16"),
        "blk.0.attn_norm.weight": ([64], "F32"), "blk.0.attn_norm_2.weight": ([64], "F32"),
        "blk.0.attn_q.weight": ([128, 64], "BF16"), "blk.0.attn_k.weight": ([128, 32], "BF16"),
        "blk.0.attn_v.weight": ([128, 32], "BF16"), "blk.0.attn_output.weight": ([64, 64], "BF16"),
        "blk.0.ffn_norm.weight": ([64], "F32"), "blk.0.ffn_gate.weight": ([64, 128], "BF16"),
        "blk.0.ffn_up.weight": ([64, 128], "BF16"), "blk.0.ffn_down.weight": ([128, 64], "BF16"),
        "d2t": ([VD], "I64"),
    }
    got = {t.name: ([int(n) for n in t.shape], t.tensor_type.name) for t in r.tensors}
    assert got == want
    # d2t holds absolute target ids (conversion/llama.py prepare_tensors adds arange)
    d2t = next(t for t in r.tensors if t.name == "d2t")
    assert d2t.data.tolist() == head.draft_ids().tolist()


def test_qk_rows_follow_ggml_rope():
    """GGML's NORM RoPE rotates adjacent pairs; HF rotates halves. Permuted rows make them agree."""
    n_head, dh, d = 3, 8, 5
    w = torch.randn(n_head * dh, d)
    x = torch.randn(d)
    angle = torch.rand(dh // 2) * 3

    def rope_half(q):  # HF: (q[i], q[i + dh/2]) rotated by angle[i]
        a, b = q[: dh // 2], q[dh // 2:]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()])

    def rope_pairs(q):  # GGML NORM: (q[2i], q[2i + 1]) rotated by angle[i]
        a, b = q[0::2], q[1::2]
        return torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1).flatten()

    hf = torch.cat([rope_half(h) for h in (w @ x).view(n_head, dh)])
    ggml = torch.cat([rope_pairs(h) for h in (permute_rows(w, n_head) @ x).view(n_head, dh)])
    assert torch.allclose(permute_rows(hf[:, None], n_head)[:, 0], ggml, atol=1e-6)
    assert torch.equal(unpermute_rows(permute_rows(w, n_head), n_head), w)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_round_trip_is_exact(tiny, tmp_path, kind, norm_before_residual):
    cfg = tiny.native(kind).config
    head = head_for(cfg)
    head.cfg.norm_before_residual = head.midlayer.norm_before_residual = norm_before_residual
    got = load_eagle3_gguf(save_eagle3_gguf(head, tmp_path / "h.gguf"), cfg)
    assert got.cfg.norm_before_residual is norm_before_residual and got.cfg.aux_layers == (0, 1, 2)
    a, b = head.state_dict(), got.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(head.inv_freq, got.inv_freq)
    has_rope = "rope_freqs.weight" in {t.name for t in GGUFReader(str(tmp_path / "h.gguf")).tensors}
    assert has_rope is (kind == "llama3_rope")  # llama3 scaling travels as rope_freqs (conversion/llama.py)


def test_heads_llama_cpp_cannot_compute_are_refused(tiny, tmp_path):
    head = head_for(tiny.native("llama_bias").config)
    bad = Eagle3Head(Eagle3Config(head.cfg.model.__class__(**{**head.cfg.model.__dict__, "qkv_bias": True,
                                                                "o_bias": True}), VD, (0, 1, 2)))
    with pytest.raises(ValueError, match="loads no bias tensors"):
        save_eagle3_gguf(bad, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="exactly 3"):
        save_eagle3_gguf(head_for(tiny.native("llama", num_hidden_layers=4).config, aux=(0, 1, 2, 3)),
                         tmp_path / "c.gguf")


@pytest.mark.slow
def test_vocabulary_is_the_targets(tmp_path, default_target):
    """llama.cpp compares draft and target vocabularies (common_speculative_are_compatible)."""
    from eyas.models.loading import embedded_gguf_path

    head = head_for(default_target.model.config, aux=(2, 15, 27))
    out = save_eagle3_gguf(head, tmp_path / "h.gguf", vocab_from=embedded_gguf_path())
    ours, target = GGUFReader(str(out)), GGUFReader(str(embedded_gguf_path()))
    keys = [k for k in target.fields if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in keys and "tokenizer.ggml.merges" in keys
    for k in keys:
        assert ours.fields[k].contents() == target.fields[k].contents(), k
