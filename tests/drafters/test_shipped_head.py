"""The shipped EAGLE-3 head for the embedded SmolLM2 (eyas/heads): loads, drafts, stays lossless.

Real weights on the real target, since what matters here is the trained head itself: that it is
the embedded model's default drafter, that its trees (the recommended one and a static one) keep
greedy output identical to plain decoding in fp32 and in bf16 exact mode, and that it accepts
what a trained head should (a random head accepts almost nothing).
"""

from __future__ import annotations

import pytest
import torch

import eyas
from eyas.drafters.eagle3 import Eagle3Drafter
from eyas.drafters.loading import recommended_tree, shipped_head

PROMPTS = ("Give three tips for staying healthy.", "What is 12 times 7? Explain step by step.")
NEW = 40


@pytest.fixture(scope="module")
def head_dir(default_target):
    d = shipped_head(default_target.name)
    assert d is not None, "the embedded model has no shipped head registered in eyas.drafters.loading"
    return d


def test_default_drafter_of_the_embedded_model_is_the_hybrid_over_the_shipped_head(default_target, head_dir):
    from eyas.drafters.hybrid import HybridDrafter

    spec = eyas.load(drafter="default", dtype="float32")
    assert isinstance(spec.drafter, HybridDrafter)
    assert isinstance(spec.drafter.head, Eagle3Drafter)  # the shipped head drafts the tree lookup joins
    assert recommended_tree(head_dir) is not None


@pytest.mark.parametrize("tree", (None, "static:[[0],[1],[0,0],[0,0,0],[1,0]]"))
def test_shipped_head_greedy_equals_plain_fp32(head_dir, tree):
    spec = eyas.load(drafter=str(head_dir), dtype="float32", tree=tree)
    taus = []
    for p in PROMPTS:
        ref = spec.generate(p, max_new_tokens=NEW, speculate=False)
        out = spec.generate(p, max_new_tokens=NEW)
        assert out.token_ids == ref.token_ids, p
        taus.append(out.mean_accepted)
    # trained, not random: it accepts on these everyday prompts (measured 1.5-2.2; random heads stay near 1.0)
    assert sum(taus) / len(taus) > 1.3, taus


def test_shipped_head_bf16_exact_mode_equals_plain(head_dir):
    """bf16 exact mode with branching trees: identical to plain decoding in the same mode (PathAttention)."""
    spec = eyas.load(drafter=str(head_dir), dtype="bfloat16")
    assert spec.exact and spec.target.model.dtype == torch.bfloat16
    for p in PROMPTS:
        ref = spec.generate(p, max_new_tokens=NEW, speculate=False)
        assert spec.generate(p, max_new_tokens=NEW).token_ids == ref.token_ids, p


def test_a_head_kind_named_alone_takes_the_shipped_head(default_target, head_dir):
    """`--drafter eagle3` on the embedded default: its shipped EAGLE-3 head alone (no lookup), with its tree."""
    from eyas.drafters.loading import DrafterSpec, build_drafter

    d = build_drafter(DrafterSpec(name="eagle3"), default_target)
    assert type(d) is Eagle3Drafter
    assert d.max_nodes == build_drafter(DrafterSpec(name=str(head_dir)), default_target).max_nodes


def test_a_head_kind_named_alone_without_a_shipped_head_says_what_to_pass(tiny):
    from types import SimpleNamespace

    from eyas.drafters.loading import DrafterSpec, build_drafter

    target = SimpleNamespace(model=tiny.native("llama"), name="/some/local/model")
    for kind in ("eagle3", "eagle"):
        with pytest.raises(ValueError, match=rf"the {kind} drafter needs a head directory: --drafter PATH.*has none"):
            build_drafter(DrafterSpec(name=kind), target)
