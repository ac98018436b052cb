"""The hybrid drafter: prompt lookup and an EAGLE head in one tree, lossless.

* Greedy speculative decoding equals plain greedy decoding token for token (fp32 tiny models,
  random EAGLE-3 heads + lookup, several budgets; bf16 exact mode), and on the embedded default
  with the shipped head (``slow``: fp32 and bf16 exact).
* Lookup chains reach the tree and are accepted on repetitive text; the tree never exceeds the budget.
* Sampling: a seeded run is deterministic, and one verify step over a hybrid tree emits tokens
  distributed as the target (chi-square, the helper of tests/verify/test_rejection.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.base import get_drafter_factory
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.drafters.hybrid import HybridConfig, HybridDrafter, LookupStats, SuffixIndex, lookup_chains
from eyas.tree.merge import Chain
from eyas.types import SamplingParams
from eyas.verify import logits_to_probs

VOCAB = 256  # the tiny models' vocabulary (tests/conftest.py)
N = 32
KINDS = ("llama", "qwen3")


def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + 17 * n + seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


def hybrid(target, tree: str = "dynamic:4,4,12", sharp: bool = False, **cfg) -> HybridDrafter:
    head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
    if sharp:  # logits x10: confident enough for an adaptive tree to vary (tests/test_lossless.py)
        with torch.no_grad():
            head.lm_head.weight *= 10
    return HybridDrafter(head_drafter=Eagle3Drafter(target_model=target, head=head, tree=tree), cfg=HybridConfig(**cfg))


def run(target, drafter, prompt, n: int = N, **cfg):
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n, **cfg))
    events = list(dec.generate(prompt))
    return [t for ev in events for t in ev.tokens.tolist()], dec


@pytest.fixture(params=KINDS)
def target(tiny, request):
    return tiny.native(request.param, seed=0)


# ---- lookup ---------------------------------------------------------------------------------------
def test_lookup_chains_prefer_the_longest_suffix_and_score_by_its_length():
    cfg = HybridConfig(max_ngram=2, num_draft=3, lookup_accept=(0.2, 0.6))
    chains = lookup_chains(torch.tensor([5, 7, 9, 5, 7]), cfg)
    assert [c.tokens for c in chains] == [[9, 5, 7]]
    assert chains[0].step_logp == pytest.approx([math.log(0.6)] * 3)
    one = lookup_chains(torch.tensor([5, 8, 1, 5]), cfg)  # only a 1-token suffix matches
    assert [c.tokens for c in one] == [[8, 1, 5]] and one[0].step_logp[0] == pytest.approx(math.log(0.2))
    assert lookup_chains(torch.tensor([1, 2, 3]), cfg) == [] and lookup_chains(torch.tensor([4]), cfg) == []


def test_config_validation():
    with pytest.raises(ValueError):
        HybridConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        HybridConfig(lookup_accept=(0.5, 1.5))
    with pytest.raises(ValueError):
        HybridConfig(budget=-1)


def test_static_head_trees_are_refused(tiny):
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
    with pytest.raises(ValueError, match="dynamic"):
        HybridDrafter(head_drafter=Eagle3Drafter(target_model=target, head=head, tree="static:eagle_small"))


def test_registered_by_name():
    assert get_drafter_factory("hybrid") is HybridDrafter


# ---- greedy losslessness ----------------------------------------------------------------------------
@pytest.mark.parametrize("budget", (0, 3, 8, 20))
@pytest.mark.parametrize("plen", (1, 7, 30))
def test_greedy_equals_plain(target, budget, plen):
    p = prompt_ids(plen)
    ref = run(target, None, p)[0]
    drafter = hybrid(target, budget=budget)
    out, dec = run(target, drafter, p)
    assert out == ref
    assert drafter.max_nodes == (budget or 13)
    assert dec.stats.drafted <= dec.stats.steps * (drafter.max_nodes - 1)


def test_lookup_nodes_reach_the_tree_and_get_accepted(target):
    """Random heads accept almost nothing; on the tiny models' repetitive text lookup does."""
    accepted = from_chain = 0
    for plen in (7, 30):
        p = prompt_ids(plen, seed=1)
        ref = run(target, None, p, 48)[0]
        drafter = hybrid(target, budget=10, lookup_accept=(0.9,))
        seen = []
        orig = drafter.propose

        def spy(*args, _orig=orig, _seen=seen, _d=drafter, **kw):
            out = _orig(*args, **kw)
            _seen.append(int(_d.last.from_chain.sum()))
            return out

        drafter.propose = spy
        out, dec = run(target, drafter, p, 48)
        assert out == ref
        accepted += dec.stats.accepted
        from_chain += sum(seen)
    assert from_chain > 0 and accepted > 0


def test_lookup_stats_walk_the_chain_until_the_first_miss():
    stats = LookupStats(prior=(0.3, 0.5), weight=2.0)
    stats.observe(Chain([4, 5, 6, 7], [0.0] * 4, suffix=1), [4, 5, 9])  # two taken, the third missed
    stats.observe(Chain([8, 9], [0.0] * 2, suffix=3), [1, 8])  # longer suffixes count with the last rate
    assert stats.offered == [3, 1] and stats.taken == [2, 0]
    assert stats.rates() == pytest.approx(((2 + 2 * 0.3) / (3 + 2), (0 + 2 * 0.5) / (1 + 2)))
    stats.observe(Chain([1, 2], [0.0] * 2, suffix=2), [1, 2, 3])  # the whole chain taken: no more is known
    assert stats.offered == [3, 3] and stats.taken == [2, 2]
    assert LookupStats(prior=(0.3,), weight=0.0, offered=[9], taken=[9]).rates() == (0.3,)  # weight 0: fixed


def test_lookup_rates_follow_the_sequence_and_reset_per_sequence(target):
    """On the tiny models' repetitive text lookup's chains keep being the target's tokens: the rate they are
    ranked with rises above the prior; a new sequence (start) and a fork start again from the prior.
    """
    p = prompt_ids(30, seed=1)
    drafter = hybrid(target, budget=10, lookup_accept=(0.2,), prior_weight=4.0)
    out, _ = run(target, drafter, p, 48)
    assert out == run(target, None, p, 48)[0]
    assert drafter.stats.taken[0] > 0 and drafter.stats.rates()[0] > 0.2
    assert drafter.fork().stats.rates() == (0.2,)
    drafter.start(128)
    assert drafter.stats.offered == [0] and drafter.stats.rates() == (0.2,)
    with pytest.raises(ValueError, match="prior_weight"):
        HybridConfig(prior_weight=-1)


def test_exact_mode_bf16_equals_exact_plain(tiny):
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    drafter = hybrid(target, budget=8)
    drafter.head.head = drafter.head.head.to(torch.bfloat16)
    p = prompt_ids(30, seed=8)
    ref = run(target, None, p, exact=True)[0]
    assert run(target, drafter, p, exact=True)[0] == ref


def test_fork_has_its_own_head_state(target):
    a = hybrid(target, budget=6)
    b = a.fork()
    assert b.head is not a.head and b.head.head is a.head.head  # weights shared, state not
    p1, p2 = prompt_ids(7, seed=4), prompt_ids(30, seed=5)
    r1, r2 = run(target, None, p1)[0], run(target, None, p2)[0]
    assert run(target, a, p1)[0] == r1 and run(target, b, p2)[0] == r2


@pytest.mark.parametrize("tree,sharp", [("dynamic:4,4,12", False),
                                        ("adaptive:2,4,0.3,0.05/0.05/0.2/0.3/0.5/0.7", True)])
def test_batched_rows_with_cut_trees_equal_plain(tiny, tree, sharp):
    """eyas serve's path: forked hybrid drafters per row, the load policy cutting trees (ranked nodes); with an
    adaptive tree, rows' trees differ in size from step to step as well."""
    from eyas.batch import BatchDecoder
    from eyas.policy import CostTable, PolicyConfig, SpecPolicy

    target = tiny.native("llama", seed=0)
    drafter = hybrid(target, tree, sharp, budget=9)
    policy = SpecPolicy(9, PolicyConfig(min_observations=2), CostTable({1: 1.0, 2: 1.0, 4: 1.1, 8: 3.0, 32: 20.0}))

    def make(speculate=True, max_new_tokens=24, **kw):
        return SpecDecoder(target, drafter.fork() if speculate else None,
                           DecodeConfig(max_new_tokens=max_new_tokens, **kw))

    batch = BatchDecoder(target, make, 3, policy, drafter.taps, initial_slots=16)
    prompts = {i: prompt_ids(n, seed=10 + i) for i, n in enumerate((7, 30, 12))}
    out = {k: [] for k in prompts}
    for k, p in prompts.items():
        ev = batch.add(k, p)  # None while other rows decode: prefilled in the next step
        out[k] += ev.tokens.tolist() if ev is not None else []
    while len(batch):
        for k, ev in batch.step():
            out[k] += ev.tokens.tolist()
            if ev.finished:
                batch.remove(k)
    for k, p in prompts.items():
        assert out[k] == run(target, None, p, 24)[0], k
    assert policy.curve.seen[9] >= 2


# ---- sampling ---------------------------------------------------------------------------------------
def test_sampling_is_deterministic_per_seed(target):
    p = prompt_ids(7, seed=6)
    sp = SamplingParams(temperature=0.8, top_p=0.9)

    def sample_run(seed: int) -> list[int]:
        out = run(target, hybrid(target, budget=8), p, sampling=sp, seed=seed)[0]
        assert len(out) == N and all(0 <= t < VOCAB for t in out)
        return out

    a = sample_run(123)
    assert sample_run(123) == a
    assert any(sample_run(s) != a for s in (7, 8, 9)), "different seeds gave the same sample every time"


@pytest.mark.parametrize("tree,sharp,mass", [("dynamic:4,2,6", False, 0.3),
                                             ("adaptive:3,3,0.3,0.02/0.04/0.1/0.2/0.3/0.4", True, 0.15)])
def test_one_verify_step_over_a_hybrid_tree_samples_the_target(tiny, stats, tree, sharp, mass):
    """First two emitted tokens of one step ~ p(a) p(b | a), over a tree holding lookup and head nodes (a fixed
    EAGLE-2 tree, and an adaptive one: its shape is a function of the history, as a fixed tree's tokens are)."""
    target = tiny.native("llama", seed=0)
    sp = SamplingParams(temperature=1.5, top_k=6)
    for seed in range(60):  # a prompt whose tree holds a lookup chain and likely root children
        drafter = hybrid(target, tree, sharp, budget=9, lookup_accept=(0.9,))
        dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=8, sampling=sp, seed=seed))
        p = prompt_ids(7, seed=seed)
        p = torch.cat([p, torch.tensor(run(target, None, p, 40)[0])])  # the tiny models' text repeats itself
        seq = dec.prefill(p)
        draft = dec.draft(seq)
        probs = logits_to_probs(dec.verify_forward(seq, draft.tree).logits[0], sp)
        root_kids = draft.tree.tokens[draft.tree.parents == 0]
        if drafter.last.from_chain.any() and float(probs[0, root_kids].sum()) > mass:
            break
    else:
        raise AssertionError("no prompt gave a hybrid tree with a lookup chain and likely root children")
    accepted, p_value = stats.two_token_check(target, seq.history, draft, probs, sp, VOCAB)
    assert accepted > 300
    assert p_value > 1e-3


# ---- the embedded default with the shipped head --------------------------------------------------------
PROMPTS = ("Give three tips for staying healthy.",
           "Repeat this list back in reverse order: apple, banana, cherry, date, elderberry, fig.")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_embedded_default_with_the_shipped_head_equals_plain(default_target, dtype):
    import eyas

    spec = eyas.load(drafter="hybrid", dtype=dtype, tree="dynamic:4,3,4", budget=8)
    assert isinstance(spec.drafter, HybridDrafter) and spec.drafter.max_nodes == 8
    # exact mode: always in bf16; in float32 where the GGUF blocks and the compiled kernels make it the faster mode
    from eyas import kernels
    assert spec.exact == (dtype == "bfloat16" or (kernels.LAYER_OPS() is not None
                                                  and spec.target.model.path_kernel() is not None))
    taus = []
    for q in PROMPTS:
        ref = spec.generate(q, max_new_tokens=40, speculate=False)
        out = spec.generate(q, max_new_tokens=40)
        assert out.token_ids == ref.token_ids, q
        taus.append(out.mean_accepted)
    assert sum(taus) / len(taus) > 1.5, taus  # a trained head plus lookup accepts (a random head: about 1.0)


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (2, 2), (4, 1)])
def test_suffix_index_chains_equal_the_scan_as_the_text_grows(max_ngram, min_ngram):
    """The incremental index gives the history scan's chain at every length: small vocabularies (many repeats),
    growth by one token and by several (accepted drafts), and a history that is not an extension (rebuilt)."""
    cfg = HybridConfig(max_ngram=max_ngram, min_ngram=min_ngram, num_draft=4)
    g = torch.Generator().manual_seed(max_ngram)
    for vocab in (2, 3, 6):
        text = torch.randint(0, vocab, (120,), generator=g)
        index, n = SuffixIndex(max_ngram), 1
        while n <= text.shape[0]:
            index.update(text[:n])
            assert index.chains(cfg) == lookup_chains(text[:n], cfg), (vocab, n)
            n += 1 + int(torch.randint(0, 3, (1,), generator=g))
        other = torch.randint(0, vocab, (30,), generator=g)
        index.update(other)
        assert index.tokens == other.tolist() and index.chains(cfg) == lookup_chains(other, cfg)
