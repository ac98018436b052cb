"""HFTarget (any transformers causal LM) equals NativeLlama / plain transformers."""

from __future__ import annotations

import pytest
import torch

from eyas.models.config import ModelConfig
from eyas.models.hf import HFTarget

# fp32 CPU: HFTarget re-runs the whole sequence in one forward, native runs chunks
# through its KV cache; they differ only by matmul-shape rounding (measured max
# |diff| ~1e-6 on logits of std ~0.6)
ATOL = 1e-4

PREFIX = 10
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def _chunks(target, x: torch.Tensor, sizes, taps=()):
    """Feed x [1, L] in chunks; return each chunk's ForwardOutput."""
    cache, lo, outs = target.new_cache(1, 32), 0, []
    for size in sizes:
        outs.append(
            target.forward(x[:, lo : lo + size], torch.arange(lo, lo + size)[None], cache, lo, taps=taps)
        )
        lo += size
    return outs


def _tree(target, tiny, prefix, node_tokens):
    cache = target.new_cache(1, 32)
    target.forward(prefix, torch.arange(PREFIX)[None], cache, 0)
    toks, pos, mask = tiny.tree_inputs(PARENTS, node_tokens, PREFIX)
    return target.forward(toks, pos, cache, PREFIX, mask=mask, taps=(0, 2))


def test_prefill_and_chunks_match_native(tiny, tiny_kind):
    hf, native = tiny.pair(tiny_kind)
    target, x = HFTarget(hf), tiny.tokens(20)
    for sizes in ([20], [12, 1, 7]):
        got, want = _chunks(target, x, sizes, taps=(0, 1, 2)), _chunks(native, x, sizes, taps=(0, 1, 2))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.logits, w.logits, atol=ATOL, rtol=0)
            torch.testing.assert_close(g.hidden, w.hidden, atol=ATOL, rtol=0)
            for i in (0, 1, 2):
                torch.testing.assert_close(g.taps[i], w.taps[i], atol=ATOL, rtol=0)


def test_tree_matches_native(tiny, tiny_kind):
    hf, native = tiny.pair(tiny_kind)
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    got, want = _tree(HFTarget(hf), tiny, prefix, node_tokens), _tree(native, tiny, prefix, node_tokens)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.taps[2], want.taps[2], atol=ATOL, rtol=0)


def test_eager_equals_sdpa_and_logits_idx(tiny):
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    sdpa = _tree(HFTarget(tiny.hf("qwen3", attn="sdpa")), tiny, prefix, node_tokens)
    eager_target = HFTarget(tiny.hf("qwen3", attn="eager"))
    eager = _tree(eager_target, tiny, prefix, node_tokens)
    torch.testing.assert_close(eager.logits, sdpa.logits, atol=ATOL, rtol=0)
    cache = eager_target.new_cache(1, 32)
    rows = eager_target.forward(prefix, torch.arange(PREFIX)[None], cache, 0, logits_idx=torch.tensor([9, 3]))
    full = eager_target.forward(prefix, torch.arange(PREFIX)[None], cache, 0)
    assert rows.logits.shape == (1, 2, 256)
    torch.testing.assert_close(rows.logits, full.logits[:, [9, 3]], atol=ATOL, rtol=0)


def test_left_padded_batch_matches_native(tiny):
    """Pad slots are masked out as keys; HFTarget re-runs prefix rows with their write-time masks."""
    hf, native = tiny.pair("qwen2")
    pad = torch.tensor([3, 0])  # row 0 starts with 3 pad slots
    x = torch.cat([tiny.tokens(15, seed=4), tiny.tokens(15, seed=5)])
    slots = torch.arange(15)
    pos = (slots[None] - pad[:, None]).clamp(min=0)  # [2, 15]
    real = slots[None] >= pad[:, None]  # [2, 15] slot holds a real token
    # [2, 15, 15] causal, keys must be real tokens; a pad slot attends only itself
    mask = (slots[None, :, None] >= slots[None, None, :]) & (
        real[:, None, :] | torch.eye(15, dtype=torch.bool)
    )
    outs = []
    for target in (HFTarget(hf), native):
        cache = target.new_cache(2, 16)
        target.forward(x[:, :11], pos[:, :11], cache, 0, mask=mask[:, :11, :11])
        outs.append(target.forward(x[:, 11:], pos[:, 11:], cache, 11, mask=mask[:, 11:]).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=0)


def test_commit_then_continue_matches_native(tiny):
    hf, native = tiny.pair("llama3_rope")
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    path = torch.tensor([0, 2, 5, 7])
    nxt, pos = tiny.tokens(1, seed=3), torch.tensor([[PREFIX + 4]])
    logits = []
    for target in (HFTarget(hf), native):
        cache = target.new_cache(1, 32)
        target.forward(prefix, torch.arange(PREFIX)[None], cache, 0)
        toks, tpos, mask = tiny.tree_inputs(PARENTS, node_tokens, PREFIX)
        target.forward(toks, tpos, cache, PREFIX, mask=mask)
        target.commit(cache, PREFIX, path)
        logits.append(target.forward(nxt, pos, cache, PREFIX + 4).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("mistral", {"sliding_window": 4}),  # one mask for all layers
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),  # mixed layers
    ],
    ids=["mistral", "qwen2_mixed"],
)
def test_sliding_window_matches_plain_hf(tiny, kind, overrides):
    """The custom mask bypasses transformers' window; HFTarget must re-apply it."""
    hf = tiny.hf(kind, **overrides)
    x = tiny.tokens(16)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        unwindowed = tiny.hf(kind)(input_ids=x).logits
    assert not torch.allclose(ref, unwindowed, atol=1e-2), "window too wide to matter in this test"
    got = torch.cat([o.logits for o in _chunks(HFTarget(hf), x, [9, 1, 6])], dim=1)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg).eval().requires_grad_(False)


def test_non_llama_model_tree_and_config(tiny):
    """GPT-2 (learned absolute positions, no native support) through the same contract."""
    hf = _tiny_gpt2()
    target = HFTarget(hf)
    assert (target.config.vocab_size, target.config.hidden_size, target.config.num_layers) == (256, 64, 3)
    assert target.config.model_type == "gpt2"
    prefix, node_tokens = tiny.tokens(PREFIX), tiny.tokens(len(PARENTS), seed=2)[0]
    out = _tree(target, tiny, prefix, node_tokens)
    for node in range(len(PARENTS)):
        seq = torch.cat([prefix[0], node_tokens[tiny.path(PARENTS, node)]])[None]
        with torch.no_grad():
            ref = hf(input_ids=seq, output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, node], ref.logits[0, -1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[0, node], ref.hidden_states[-1][0, -1], atol=ATOL, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(target.lm_head(out.hidden).float(), out.logits, atol=ATOL, rtol=0)


def test_config_embed_and_errors(tiny):
    hf = tiny.hf("qwen2")
    target = HFTarget(hf)
    assert target.config == ModelConfig.from_hf(hf.config.to_dict())
    assert target.dtype == torch.float32 and target.device == torch.device("cpu")
    x = tiny.tokens(5)
    torch.testing.assert_close(target.embed(x), hf.get_input_embeddings()(x))
    cache = target.new_cache(1, 8)
    with pytest.raises(ValueError, match="cache overflow"):
        target.forward(tiny.tokens(9), torch.arange(9)[None], cache, 0)
    with pytest.raises(ValueError, match="taps"):
        target.forward(x, torch.arange(5)[None], cache, 0, taps=(3,))
