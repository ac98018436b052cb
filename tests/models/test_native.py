"""NativeLlama equals transformers on the same weights (fp32, CPU).

Every case compares native logits / features with a plain transformers forward
over the same token sequence (no cache), so it also checks the native KV cache,
its masks and its positions.
"""

from __future__ import annotations

import pytest
import torch

# fp32 on CPU: native and transformers run the same ops in the same order, so the
# tiny models agree to ~1e-6 (measured max |diff| 0 to 5e-6); 1e-4 leaves headroom
# for other BLAS builds while still catching any real mistake (logit std ~0.6).
ATOL = 1e-4
# the 30-layer embedded default accumulates more rounding (measured max |diff| ~1e-4
# on logits of magnitude ~20)
DEFAULT_ATOL = 2e-3

PREFIX = 10
# a small tree on top of the prefix: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> 5, 3 -> 6, 5 -> 7
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def hf_run(hf, tokens: torch.Tensor):
    """Plain transformers forward (no cache, default causal mask and positions)."""
    with torch.no_grad():
        return hf(input_ids=tokens, output_hidden_states=True)


def test_prefill_matches_hf(tiny, tiny_kind):
    hf, native = tiny.pair(tiny_kind)
    x = tiny.tokens(20)
    out = native.forward(x, torch.arange(20)[None], native.new_cache(1, 32), 0)
    ref = hf_run(hf, x)
    assert out.logits.shape == (1, 20, hf.config.vocab_size)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_hf(tiny, tiny_kind):
    """Chunks of 12, 1 and 7 tokens through the cache (start > 0), the last one with kv_len = cache size."""
    hf, native = tiny.pair(tiny_kind)
    x = tiny.tokens(20)
    ref = hf_run(hf, x).logits
    cache = native.new_cache(1, 32)
    pos = torch.arange(20)[None]
    for lo, hi, kv_len in ((0, 12, None), (12, 13, None), (13, 20, 32)):
        out = native.forward(x[:, lo:hi], pos[:, lo:hi], cache, lo, kv_len=kv_len)
        torch.testing.assert_close(out.logits, ref[:, lo:hi], atol=ATOL, rtol=0)


def test_tree_forward_matches_each_path(tiny, tiny_kind):
    """Each tree node's logits equal transformers run on prefix + that node's root-to-node path."""
    hf, native = tiny.pair(tiny_kind)
    prefix = tiny.tokens(PREFIX)
    node_tokens = tiny.tokens(len(PARENTS), seed=2)[0]
    cache = native.new_cache(1, 32)
    native.forward(prefix, torch.arange(PREFIX)[None], cache, 0)
    toks, pos, mask = tiny.tree_inputs(PARENTS, node_tokens, PREFIX)
    out = native.forward(toks, pos, cache, PREFIX, mask=mask)
    for node in range(len(PARENTS)):
        path = node_tokens[tiny.path(PARENTS, node)]
        ref = hf_run(hf, torch.cat([prefix[0], path])[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node], ref, atol=ATOL, rtol=0, msg=f"node {node}")


def test_taps_hidden_and_logits_idx(tiny, tiny_kind):
    """taps[i] = hidden_states[i] (input of layer i); hidden = hidden_states[-1] (after the final norm)."""
    hf, native = tiny.pair(tiny_kind)
    x = tiny.tokens(16)
    layers = tuple(range(hf.config.num_hidden_layers))
    cache = native.new_cache(1, 32)
    native.forward(x[:, :9], torch.arange(9)[None], cache, 0)
    out = native.forward(
        x[:, 9:], torch.arange(9, 16)[None], cache, 9, taps=layers, logits_idx=torch.tensor([0, 6])
    )
    ref = hf_run(hf, x)
    assert sorted(out.taps) == list(layers)
    for i in layers:
        torch.testing.assert_close(out.taps[i], ref.hidden_states[i][:, 9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1][:, 9:], atol=ATOL, rtol=0)
    # hidden really is the normed feature: lm_head(hidden) gives the logits
    with torch.inference_mode():
        torch.testing.assert_close(native.lm_head(out.hidden), ref.logits[:, 9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, ref.logits[:, [9, 15]], atol=ATOL, rtol=0)


@pytest.mark.slow  # the realism case: the real embedded default model
def test_default_target_matches_hf(default_target):
    """The embedded default (SmolLM2-135M, 30 layers, tied embeddings) on a real prompt, in two chunks."""
    from transformers import AutoModelForCausalLM

    native, tok = default_target.model, default_target.tokenizer
    prompt = "Speculative decoding is lossless because the target model checks every"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(default_target.path, dtype=torch.float32).eval()
    ref = hf_run(hf, ids)
    t, half = ids.shape[1], ids.shape[1] // 2
    cache = native.new_cache(1, t)
    native.forward(ids[:, :half], torch.arange(half)[None], cache, 0)
    out = native.forward(ids[:, half:], torch.arange(half, t)[None], cache, half, taps=(0, 15, 29))
    torch.testing.assert_close(out.logits, ref.logits[:, half:], atol=DEFAULT_ATOL, rtol=0)
    for i in (0, 15, 29):
        torch.testing.assert_close(out.taps[i], ref.hidden_states[i][:, half:], atol=DEFAULT_ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1][:, half:], atol=DEFAULT_ATOL, rtol=0)
    assert torch.equal(out.logits.argmax(-1), ref.logits[:, half:].argmax(-1))


def test_vocab_logits_matches_linear_and_follows_weight_updates():
    from eyas.models.native import vocab_logits

    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 40, bias=False).requires_grad_(False)
    for m in (1, 2, 9, 70):  # transposed-copy GEMV, W @ x.T, F.linear
        x = torch.randn(1, m, 16)
        torch.testing.assert_close(vocab_logits(proj, x), torch.nn.functional.linear(x, proj.weight))
    x = torch.randn(1, 1, 16)
    vocab_logits(proj, x)
    proj.weight.mul_(2.0)  # the cached transposed copy must not go stale
    torch.testing.assert_close(vocab_logits(proj, x), torch.nn.functional.linear(x, proj.weight))
    trainable = torch.nn.Linear(16, 40, bias=False)  # training: the autograd path, untouched
    assert vocab_logits(trainable, torch.randn(3, 16)).grad_fn is not None


def test_fused_and_unfused_checkpoints_load_alike(tiny, tiny_kind):
    """HF checkpoints (q/k/v_proj, gate/up_proj) are fused at load; already-fused ones load as they are."""
    from eyas.models.native import NativeLlama, fuse_hf_state_dict

    hf, native = tiny.pair(tiny_kind)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    fused = fuse_hf_state_dict(sd)
    assert not any(".q_proj." in k or ".gate_proj." in k for k in fused)
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == sum(
        sd[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv")
    other = NativeLlama(native.config)
    other.load_hf_state_dict(fused)  # a checkpoint saved with fused names
    other.inv_freq = native.inv_freq
    x = tiny.tokens(12)
    a = native.forward(x, torch.arange(12)[None], native.new_cache(1, 16), 0).logits
    b = other.eval().forward(x, torch.arange(12)[None], other.new_cache(1, 16), 0).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="missing"):
        NativeLlama(native.config).load_hf_state_dict({k: v for k, v in sd.items() if ".v_proj." not in k})


# bf16: native rounds differently from transformers (fused RMSNorm rounds once, RoPE's addcmul once, attention in
# fp32 over an fp32 copy of the bf16 keys); measured max |diff| ~0.03 on tiny-model logits of std ~0.6
BF16_ATOL = 0.1


def test_bf16_prefill_and_decode_match_hf_within_tolerance(tiny, tiny_kind):
    hf, native = tiny.pair(tiny_kind)
    hf, native = hf.to(torch.bfloat16), native.to(torch.bfloat16)
    x = tiny.tokens(20)
    ref = hf_run(hf, x).logits.float()
    cache = native.new_cache(1, 32)
    native.forward(x[:, :19], torch.arange(19)[None], cache, 0)
    out = native.forward(x[:, 19:], torch.tensor([[19]]), cache, 19).logits
    torch.testing.assert_close(out, ref[:, 19:], atol=BF16_ATOL, rtol=0)
    assert cache.k.dtype == torch.float32  # bf16 on a CPU keeps an fp32 cache (faster attention)
