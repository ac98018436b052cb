"""Training features through SDPA's own causal flag equal the explicit mask's.

The featurizer's pass over a batch padded on the right is causal from slot 0, so it gives SDPA ``is_causal`` and
no [B, 1, T, T] mask (``ForwardMeta.causal``): on a GPU its flash kernels can then serve (eyas.train.features).
"""

from __future__ import annotations

import torch

from eyas.models.base import ForwardMeta
from eyas.train.features import TargetFeaturizer, attention_backends
from tests.conftest import tiny_native


def test_featurizer_causal_pass_gives_the_masked_features():
    target = tiny_native("llama", seed=4)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, target.config.vocab_size, (2, 19), generator=g)
    ids[1, 12:] = 0  # the second conversation is 12 tokens, padded on the right
    real = ids != 0
    loss = real.clone()
    loss[:, :4] = False
    fb = TargetFeaturizer(target, (0, 1))(ids, real, loss)
    n = ids.shape[1]
    pos = torch.arange(n)[None].expand(2, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril().expand(2, n, n)
    ref = target.forward(ids, pos, target.new_cache(2, n), 0, mask=mask, taps=(0, 1))
    # padding attends only what comes before it either way: every position is compared
    assert torch.allclose(fb.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
    assert torch.allclose(fb.taps, torch.stack([ref.taps[0], ref.taps[1]], dim=2), atol=1e-5, rtol=1e-5)
    assert torch.equal(fb.target_tokens[loss], ref.logits.argmax(-1)[loss])


def test_causal_flag_only_for_a_fresh_unmasked_pass():
    target = tiny_native("llama", seed=4)
    cache = target.new_cache(2, 32)
    tokens = torch.zeros(2, 5, dtype=torch.long)

    def meta(**kw):
        return target._attn_meta(tokens, cache, ForwardMeta(**{"start": 0, "causal": True, **kw}))

    fresh = meta()
    assert fresh.causal and fresh.mask is None and fresh.kv_len == 5
    assert not meta(causal=False).causal and meta(causal=False).mask is not None  # inference: the mask, as before
    assert not meta(start=3).causal  # after cached slots SDPA's flag would align the diagonal to the wrong slot
    assert not meta(kv_len=8).causal  # more slots than rows
    assert not meta(mask=torch.ones(2, 5, 5, dtype=torch.bool)).causal
    assert not target._attn_meta(tokens[:, :1], cache, ForwardMeta(start=0, causal=True)).causal  # one row


def test_attention_backends_is_a_no_op_off_cuda():
    q = torch.randn(1, 2, 4, 8)
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    with attention_backends(torch.device("cpu")):
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.allclose(y, torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=tril))
