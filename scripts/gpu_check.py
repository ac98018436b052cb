"""Greedy losslessness of every drafter on a CUDA device (tiny random Llama; not part of CI), and exact mode's
prefix cache: a prompt that starts with a stored one fills the same cache bits and decodes the same tokens; and
training features through SDPA's causal flag (flash kernels, no cuDNN) against the explicit mask's.

python scripts/gpu_check.py            # prints one line per case, exits 1 on a mismatch
"""

from __future__ import annotations

import sys
import time

import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.draft_lm import DraftLMDrafter
from eyas.drafters.eagle import EagleDrafter, random_head
from eyas.drafters.ngram import NgramDrafter
from eyas.kv.prefix import PrefixStore
from eyas.models.config import ModelConfig
from eyas.models.native import NativeLlama
from eyas.train.features import TargetFeaturizer


def tiny(seed: int, dev: str, dtype: torch.dtype) -> NativeLlama:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    return NativeLlama(cfg).to(dev, dtype).eval().requires_grad_(False)


def run(target, drafter, prompt, exact: bool, width: int, store=None) -> tuple[list[int], int]:
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=96, exact=exact), store)
    out = [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()]
    return out, dec.stats.accepted


def prefix_cache_check(target, drafter, dev: str) -> bool:
    """bf16 exact mode: prefill of a prompt that extends a stored one (reused from slot 32) against a fresh prefill;
    then a second turn's speculative decoding with the store against plain decoding without it.
    """
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, 96, (37,), generator=gen).to(dev)
    second = torch.cat([first, torch.randint(0, 96, (200,), generator=gen).to(dev)])
    store = PrefixStore()
    SpecDecoder(target, None, DecodeConfig(max_new_tokens=1, exact=True), store).prefill(first)
    hit = SpecDecoder(target, None, DecodeConfig(max_new_tokens=1, exact=True), store)
    a, b = hit.prefill(second), SpecDecoder(target, None, DecodeConfig(max_new_tokens=1, exact=True)).prefill(second)
    t = second.shape[0]
    same = hit.cached_prompt_tokens == 32 and all(
        torch.equal(x[:, :, :, :t], y[:, :, :, :t]) for x, y in ((a.cache.k, b.cache.k), (a.cache.v, b.cache.v)))
    run(target, drafter, first, True, drafter.max_nodes, store)
    tokens = run(target, drafter, second, True, drafter.max_nodes, store)[0] == run(target, None, second, True, 1)[0]
    print(f"prefix cache (bf16 exact): cache bits {'equal' if same else 'DIFFER'}, tokens "
          f"{'identical' if tokens else 'DIFFER'}")
    return same and tokens


def features_check(dev: str) -> bool:
    """bf16 training features (``TargetFeaturizer``: is_causal, flash or memory-efficient attention) against the
    same forward with an explicit causal mask, on a right-padded batch of two: hidden states within bf16 rounding,
    greedy labels mostly equal (a label can flip where two logits tie to within rounding).
    """
    target = tiny(0, dev, torch.bfloat16)
    ids = torch.randint(1, 96, (2, 200), generator=torch.Generator().manual_seed(2)).to(dev)
    ids[1, 150:] = 0
    real = ids != 0
    fb = TargetFeaturizer(target, (0, 1))(ids, real, real)
    n = ids.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(2, n, n)
    pos = torch.arange(n, device=dev)[None].expand(2, n)
    ref = target.forward(ids, pos, target.new_cache(2, n), 0, mask=mask)
    err = (fb.hidden.float() - ref.hidden.float()).abs().max().item()
    labels = (fb.target_tokens[real] == ref.logits.argmax(-1)[real]).float().mean().item()
    ok = err < 0.1 and labels > 0.97
    print(f"training features (bf16, is_causal against a mask): max |diff| {err:.4f}, labels equal {labels:.3f}: "
          f"{'ok' if ok else 'DIFFER'}")
    return ok


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("device:", torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch.__version__)
    bad = 0
    for dtype, exact in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        target = tiny(0, dev, dtype)
        drafters = {
            "ngram": NgramDrafter(num_draft=6, branches=2),
            "draft-lm(self)": DraftLMDrafter(model=tiny(0, dev, dtype), num_draft=4),
            "eagle-dynamic": EagleDrafter(target_model=target, head=random_head(target.config, 1, dtype).to(dev),
                                          tree="dynamic:4,4,12"),
            "eagle-static": EagleDrafter(target_model=target, head=random_head(target.config, 1, dtype).to(dev),
                                         tree="static:mc_sim_7b_63"),
            # a tree sized per step (eyas.tree.budget): feed 0 feeds every level, the prices cut its size
            "eagle-adaptive": EagleDrafter(target_model=target, head=random_head(target.config, 1, dtype).to(dev),
                                           tree="adaptive:4,4,0,0/0/0.002/0.005/0.01/0.02/0.04/0.08"),
        }
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 96, (n,), generator=gen).to(dev) for n in (1, 9, 40)]
        for name, dr in drafters.items():
            for p in prompts:
                ref, _ = run(target, None, p, exact, dr.max_nodes)
                t0 = time.perf_counter()
                got, acc = run(target, dr, p, exact, dr.max_nodes)
                same = got == ref
                bad += not same and (dtype == torch.float32 or exact)
                print(f"{str(dtype):15} exact={exact!s:5} {name:15} prompt={p.shape[0]:3} identical={same} "
                      f"accepted={acc:3} {time.perf_counter() - t0:.2f}s")
    target = tiny(0, dev, torch.bfloat16)
    bad += not prefix_cache_check(target, EagleDrafter(target_model=target, head=random_head(
        target.config, 1, torch.bfloat16).to(dev), tree="dynamic:4,4,12"), dev)
    bad += not features_check(dev)
    print("FAIL" if bad else "OK: greedy speculative == plain on", dev)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
