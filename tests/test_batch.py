"""Continuous batching (eyas.batch): every row decodes exactly as it would alone (fp32, greedy).

Rows of different prompt lengths share each verify forward, join while others are mid-way,
leave in any order (the last row moves into the hole), and drafters differ per row (one row
may decode plainly). The policy may cut trees; that must not change a single token either.
"""

from __future__ import annotations

import pytest
import torch

from eyas.batch import BatchDecoder, cut_tree
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.drafters.ngram import NgramConfig, NgramDrafter
from eyas.kv.static import KVCache
from eyas.policy import AcceptanceCurve, CostTable, PolicyConfig, SpecPolicy
from eyas.tree import make_tree
from eyas.types import DraftOutput, SamplingParams

from .test_lossless import VOCAB, prompt_ids


def solo(target, drafter, prompt, n, **cfg) -> list[int]:
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n, **cfg))
    return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()]


def make_batch(target, drafter, max_batch, policy=None, chunk=None, **cfg):
    def make(speculate=True, max_new_tokens=24, **kw):
        d = drafter.fork() if (drafter is not None and speculate) else None
        return SpecDecoder(target, d, DecodeConfig(max_new_tokens=max_new_tokens, **cfg, **kw))

    taps = drafter.taps if drafter is not None else ()
    batch = BatchDecoder(target, make, max_batch, policy, taps, initial_slots=16, exact=cfg.get("exact", False))
    if chunk is not None:  # fixed chunks of ``chunk`` tokens while rows decode (no steering by time)
        batch.prefill.chunk = chunk
        batch.prefill.pairs = batch.prefill.least = batch.prefill.most = 1 << 30
    return batch


def run_batch(batch: BatchDecoder, jobs: dict, joins: dict | None = None) -> dict:
    """jobs: key -> (prompt, params) added at step joins.get(key, 0); returns key -> tokens."""
    joins = joins or {}
    out = {k: [] for k in jobs}
    pending = dict(jobs)
    step = 0
    while pending or len(batch):
        for k in [k for k in pending if joins.get(k, 0) <= step]:
            if len(batch) == batch.max_batch:
                break
            prompt, params = pending.pop(k)
            ev = batch.add(k, prompt, **params)  # None: a long prompt, prefilled chunk by chunk in step()
            if ev is not None:
                out[k] += ev.tokens.tolist()
                if ev.finished:
                    batch.remove(k)
        if len(batch):
            for k, ev in batch.step():
                out[k] += ev.tokens.tolist()
                if ev.finished:
                    batch.remove(k)
        step += 1
    return out


def ngram():
    return NgramDrafter(NgramConfig(num_draft=4, branches=2))


@pytest.mark.parametrize("kind", ("llama", "qwen3"))
def test_rows_equal_their_solo_runs(tiny, kind):
    target = tiny.native(kind, seed=0)
    lens, news = (1, 7, 30, 12, 3), (24, 9, 17, 30, 5)
    jobs = {i: (prompt_ids(p, seed=i), {"max_new_tokens": n}) for i, (p, n) in enumerate(zip(lens, news, strict=True))}
    joins = {0: 0, 1: 0, 2: 3, 3: 5, 4: 6}  # rows join mid-way, short ones leave early
    got = run_batch(make_batch(target, ngram(), max_batch=3), jobs, joins)
    for k, (prompt, params) in jobs.items():
        assert got[k] == solo(target, None, prompt, params["max_new_tokens"]), k


def test_eagle3_rows_and_a_plain_row(tiny):
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
    drafter = Eagle3Drafter(target_model=target, head=head, tree="dynamic:4,4,12")
    jobs = {i: (prompt_ids(5 + 6 * i, seed=i), {"max_new_tokens": 20, "speculate": i != 1}) for i in range(4)}
    batch = make_batch(target, drafter, max_batch=4)
    got = run_batch(batch, jobs)
    for k, (prompt, _) in jobs.items():
        assert got[k] == solo(target, None, prompt, 20), k


def test_cache_growth_keeps_rows(tiny):
    """initial_slots=16 forces several doublings while rows are live."""
    target = tiny.native("llama", seed=0)
    jobs = {i: (prompt_ids(4 + i, seed=i), {"max_new_tokens": 40}) for i in range(3)}
    jobs[3] = (prompt_ids(60, seed=9), {"max_new_tokens": 30})
    batch = make_batch(target, ngram(), max_batch=4)
    got = run_batch(batch, jobs, {3: 4})
    assert batch.cache.max_slots >= 60 + 30
    for k, (prompt, params) in jobs.items():
        assert got[k] == solo(target, None, prompt, params["max_new_tokens"])


@pytest.mark.parametrize("mode", ("auto", "never"))
def test_policy_widths_never_change_outputs(tiny, mode):
    target = tiny.native("llama", seed=0)
    # a cost table where wide forwards are expensive: auto mode cuts trees as the batch fills
    cost = CostTable({1: 1.0, 2: 1.0, 4: 1.1, 8: 3.0, 16: 8.0, 32: 20.0, 64: 50.0})
    policy = SpecPolicy(9, PolicyConfig(mode=mode, min_observations=2), cost)
    drafter = NgramDrafter(NgramConfig(num_draft=4, branches=2))
    jobs = {i: (prompt_ids(8, seed=i), {"max_new_tokens": 30}) for i in range(4)}
    batch = make_batch(target, drafter, max_batch=4, policy=policy)
    got = run_batch(batch, jobs)
    for k, (prompt, _) in jobs.items():
        assert got[k] == solo(target, None, prompt, 30)
    if mode == "never":
        assert policy.curve.seen[9] == 0 and policy.last_width == 1
    else:
        assert policy.curve.seen[9] >= 2


def test_seeded_sampling_rows_equal_solo(tiny):
    target = tiny.native("qwen2", seed=0)
    cfg = {"sampling": SamplingParams(temperature=0.8, top_k=20)}
    jobs = {i: (prompt_ids(6 + i, seed=i), {"max_new_tokens": 16, "seed": 100 + i}) for i in range(3)}
    got = run_batch(make_batch(target, ngram(), max_batch=3, **cfg), jobs)
    for k, (prompt, _params) in jobs.items():
        ref = solo(target, ngram(), prompt, 16, seed=100 + k, **cfg)
        assert got[k] == ref


def test_cut_tree_keeps_a_valid_prefix():
    root = torch.tensor([5])
    tokens = torch.tensor([5, 1, 2, 3, 4])
    tree = make_tree(tokens, torch.tensor([-1, 0, 0, 1, 3]))
    q = torch.rand(5, 8)
    cut = cut_tree(DraftOutput(tree=tree, q=q), 3)
    assert cut.tree.tokens.tolist() == [5, 1, 2] and cut.tree.parents.tolist() == [-1, 0, 0]
    assert torch.equal(cut.tree.mask, tree.mask[:3, :3]) and cut.q.shape == (3, 8)
    assert cut_tree(DraftOutput(tree=make_tree(root, torch.tensor([-1]))), 3).tree.num_nodes == 1


def test_per_row_cache_writes():
    cache = KVCache.empty(1, 2, 1, 8, 2, torch.float32)
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    cache.update(0, torch.tensor([1, 4]), k, -k, kv_len=8)
    assert torch.equal(cache.k[0, 0, 0, 1:4], k[0, 0]) and torch.equal(cache.k[0, 1, 0, 4:7], k[1, 0])
    assert cache.k[0, 0, 0, 4:].abs().sum() == 0 and cache.k[0, 1, 0, :4].abs().sum() == 0
    cache.copy_row(1, 0, 7)
    assert torch.equal(cache.v[0, 0], cache.v[0, 1])


def test_acceptance_curve_counterfactual():
    curve = AcceptanceCurve(max_nodes=6, ema=1.0)
    curve.observe(tree_nodes=6, cut=6, path=[0, 1, 4])  # nodes 1 and 4 accepted
    assert curve.tau[2:] == [2.0, 2.0, 2.0, 3.0, 3.0]  # a cut below node 4 keeps only node 1
    curve.observe(tree_nodes=6, cut=3, path=[0, 2])  # cut at 3: w > 3 unknown, untouched
    assert curve.tau[2:] == [1.0, 2.0, 2.0, 3.0, 3.0] and curve.seen[4] == 1
    curve.observe(tree_nodes=1, cut=6, path=[0])  # a drafter miss on a full-width step: one token at every width
    assert curve.tau[2:] == [1.0] * 5 and curve.seen[6] == 2


def test_small_trees_under_a_cut_do_not_bias_the_wider_widths():
    """A drafter that sizes its trees (eyas.tree.budget) drafts small trees when unsure and large ones when sure.
    Steps cut at w say nothing about wider widths, even for trees that fit under the cut: counting only those
    (the unsure ones) made tau(6) read below tau(4) in `eyas serve`, and the policy then cut the sure trees."""
    curve = AcceptanceCurve(max_nodes=6, ema=0.5)
    for _ in range(4):
        curve.observe(tree_nodes=6, cut=6, path=[0, 1, 2, 3, 5])  # sure: 4 accepted, one of them past node 4
    for _ in range(20):
        curve.observe(tree_nodes=6, cut=4, path=[0, 1, 2, 3])  # sure trees cut at 4
        curve.observe(tree_nodes=2, cut=4, path=[0])  # unsure trees, under the cut
    assert curve.tau[6] == pytest.approx(5.0) and curve.seen[6] == 4
    assert curve.tau[6] > curve.tau[4]


def test_expected_forward_tokens_from_the_tree_sizes():
    curve = AcceptanceCurve(max_nodes=8, ema=1.0)
    assert curve.tokens(4, 1) == 4 and curve.tokens(8, 3) == 8  # nothing seen: full trees
    curve.observe(tree_nodes=3, cut=8, path=[0])
    assert curve.tokens(8, 1) == 3 and curve.tokens(2, 1) == 2
    curve = AcceptanceCurve(max_nodes=8, ema=0.5)
    curve.observe(tree_nodes=2, cut=8, path=[0])  # first observation: weight 1
    curve.observe(tree_nodes=8, cut=8, path=[0])  # then half: P(2) = P(8) = 0.5
    assert curve.tokens(8, 1) == pytest.approx(5.0)  # 0.5 * 2 + 0.5 * 8
    assert curve.tokens(8, 2) == pytest.approx(6.5)  # the wider of two rows: 2 only if both are 2 (0.25)
    assert curve.tokens(4, 2) == pytest.approx(3.5)  # cut at 4: 2 w.p. 0.25, else 4


def test_the_policy_keeps_full_width_for_a_drafter_that_sizes_its_own_trees():
    """Trees of 3 nodes mostly, 8 when sure: cost(8) is not paid on most steps, so the full width wins."""
    cost = CostTable({1: 1.0, 2: 1.1, 3: 1.1, 4: 1.25, 8: 1.9})
    policy = SpecPolicy(8, PolicyConfig(min_observations=1), cost)
    for _ in range(10):
        for _ in range(4):
            policy.curve.observe(3, 8, [0, 1])  # unsure: 2 tokens
        policy.curve.observe(8, 8, [0, 1, 2, 3, 4, 6])  # sure: 6 tokens, two of them past node 4
    assert policy.best(1) == 8
    assert policy.curve.tokens(8, 1) == pytest.approx(4.0, abs=0.3)


def test_drafter_misses_count_in_tau(tiny):
    """Steps where the drafter proposes nothing are part of tau(w): leaving them out inflates it."""

    class Silent(NgramDrafter):
        def propose(self, history, sampling, generator=None):
            root = history[-1:]
            return DraftOutput(tree=make_tree(root, torch.full_like(root, -1)))

    target = tiny.native("llama", seed=0)
    policy = SpecPolicy(9, PolicyConfig(mode="always"))
    batch = make_batch(target, Silent(), max_batch=2, policy=policy)
    run_batch(batch, {0: (prompt_ids(5), {"max_new_tokens": 6})})
    assert policy.curve.seen[9] == 5 and policy.curve.tau[9] == 1.0


def test_policy_narrows_as_the_batch_grows():
    # flat cost up to 8 tokens, then linear: speculation pays at batch 1, not at batch 16
    cost = CostTable({n: max(1.0, n / 8) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)})
    policy = SpecPolicy(9, PolicyConfig(min_observations=1), cost)
    policy.observe_draft(0.05)
    for _ in range(3):
        policy.curve.observe(9, 9, [0, 1, 3, 8])  # tau(2) = 2, tau(4) = 3, tau(9) = 4 (full trees of 9)
    widths = [policy.width(b) for b in (1, 2, 4, 16)]
    assert widths[0] == 9 and widths[-1] == 1
    assert widths == sorted(widths, reverse=True)
    assert policy.snapshot(16)["last_width"] == 1 and policy.snapshot(16, 16)["best_width_by_batch"][16] == 1


def test_calibrate_fills_the_cost_table(tiny):
    target = tiny.native("llama", seed=0)
    batch = make_batch(target, ngram(), max_batch=2, policy=SpecPolicy(9))
    batch.calibrate(context=8, repeats=1)
    assert sorted(batch.policy.cost.points) == [1, 2, 4, 8, 16, 18]
    assert all(v > 0 for v in batch.policy.cost.points.values())


def test_calibrated_cost_learns_only_the_row_overhead():
    cost = CostTable({1: 1.0, 16: 2.0}, ema=1.0, fixed=True)
    cost.observe(16, rows=4, seconds=3.0)  # 1 s beyond the calibrated forward, over 4 rows
    assert cost.points == {1: 1.0, 16: 2.0} and cost.per_row == pytest.approx(0.25)
    assert cost(16, 8) == pytest.approx(4.0) and cost(8, 1) == pytest.approx(1.0 + 7 / 15 + 0.25)


def test_chunked_prefill_interleaves_with_running_rows(tiny):
    """A long prompt joins: it is prefilled one chunk per step while the running rows keep getting tokens."""
    target = tiny.native("llama", seed=0)
    batch = make_batch(target, ngram(), max_batch=3, chunk=32)
    short = prompt_ids(5, seed=1)
    long = prompt_ids(250, seed=2)  # 8 chunks of 32
    first_a = batch.add("a", short, max_new_tokens=30)
    assert first_a is not None
    assert batch.add("b", long, max_new_tokens=10) is None
    assert len(batch) == 2 and batch.decoder("b") is not None
    seen = {"a": [], "b": []}
    for step in range(8):  # 8 chunks, one per step: "a" advances in every one of these steps
        keys = [k for k, ev in batch.step() if seen[k].append(ev) is None]
        assert "a" in keys, step
    assert any(ev.tokens.numel() for ev in seen["b"])  # its first token came with the last chunk
    out = {"a": first_a.tokens.tolist(), "b": []}
    for k, evs in seen.items():
        for ev in evs:
            out[k] += ev.tokens.tolist()
    while len(batch):
        for k, ev in batch.step():
            out[k] += ev.tokens.tolist()
            if ev.finished:
                batch.remove(k)
    assert out["a"] == solo(target, None, short, 30)
    assert out["b"] == solo(target, None, long, 10)


def test_pending_row_can_be_removed(tiny):
    target = tiny.native("llama", seed=0)
    batch = make_batch(target, None, max_batch=2, chunk=32)
    assert batch.add("x", prompt_ids(300, seed=3), max_new_tokens=5) is None  # no row decodes: chunks of 128
    batch.remove("x")
    assert len(batch) == 0 and batch.step() == []


def test_bf16_exact_batch_of_one_speculative_equals_drafter_none(tiny):
    """One text for one request: a served row (batch of one) with a drafter == SpecDecoder without one."""
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    for seed in (4, 5):
        prompt = prompt_ids(30, seed=seed)
        got = run_batch(make_batch(target, ngram(), max_batch=1, exact=True), {0: (prompt, {"max_new_tokens": 40})})
        assert got[0] == solo(target, None, prompt, 40, exact=True)


@pytest.mark.parametrize("drafter", ("ngram", "eagle3"))
def test_bf16_exact_concurrent_rows_equal_drafter_none(tiny, drafter):
    """bf16 exact mode at concurrency: every row (joining mid-way, trees of different sizes, cut by the
    policy or not) gives the tokens SpecDecoder gives that prompt alone without a drafter."""
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    d = (
        ngram()
        if drafter == "ngram"
        else Eagle3Drafter(
            target_model=target,
            head=random_eagle3_head(target.config, VOCAB // 2, seed=3).to(torch.bfloat16),
            tree="dynamic:4,3,8",
        )
    )
    lens, news = (30, 7, 52, 12), (40, 25, 30, 35)
    jobs = {
        i: (prompt_ids(p, seed=10 + i), {"max_new_tokens": n}) for i, (p, n) in enumerate(zip(lens, news, strict=True))
    }
    got = run_batch(make_batch(target, d, max_batch=3, exact=True), jobs, {0: 0, 1: 0, 2: 2, 3: 4})
    for k, (prompt, params) in jobs.items():
        assert got[k] == solo(target, None, prompt, params["max_new_tokens"], exact=True), k


def test_bf16_rows_without_exact_mode_write_the_fp32_cache(tiny):
    """Per-row cache writes (start a [B] tensor) from a bf16 model into its fp32 CPU cache."""
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    jobs = {i: (prompt_ids(p, seed=20 + i), {"max_new_tokens": 12}) for i, p in enumerate((9, 17))}
    got = run_batch(make_batch(target, ngram(), max_batch=2, exact=False), jobs)
    assert all(len(v) == 12 for v in got.values())


@pytest.mark.parametrize("kernel", [False, True], ids=["mirrors", "kernel"])
def test_bf16_exact_rows_keep_their_own_caches(tiny, monkeypatch, kernel):
    """Exact mode has no shared cache to grow: a long prompt joining leaves the short rows' caches at their own
    size (issue 14: growing a [16, S] cache to a near-context prompt stalled every stream for seconds). Without
    the compiled tree attention, a row whose tree mirror does not fit (max_mirror_bytes) verifies plain steps;
    with it no row needs a mirror. Either way: --drafter none's tokens."""
    target = tiny.native("llama", seed=0, max_position_embeddings=2048).to(torch.bfloat16)
    if not kernel:
        monkeypatch.setattr(target, "path_kernel", lambda: None)
    elif target.path_kernel() is None:
        pytest.skip("the compiled tree attention is unavailable here (eyas.kernels)")
    short, long_ = prompt_ids(9, seed=30), prompt_ids(1100, seed=31)
    one_row = target.new_cache(1, 64).nbytes // 64  # bytes per slot of a 1-row cache
    batch = make_batch(
        target, ngram(), max_batch=2, exact=True, chunk=32, max_mirror_bytes=ngram().max_nodes * one_row * 700
    )  # the long row gets no mirror
    assert batch.cache is None
    out = {"s": batch.add("s", short, max_new_tokens=30).tokens.tolist(), "l": []}
    out["s"] += [t for _, ev in batch.step() for t in ev.tokens.tolist()]
    assert batch.add("l", long_, max_new_tokens=20) is None  # chunked prefill
    while len(batch):
        for k, ev in batch.step():
            out[k] += ev.tokens.tolist()
            if ev.finished:
                batch.remove(k)
        mirrors = {r.key: r.seq.mirror is not None for r in batch.rows}
        if kernel:
            assert not any(mirrors.values()), mirrors
        else:
            assert mirrors.get("s", True) and not mirrors.get("l", False), mirrors
        sizes = {r.key: r.seq.cache.max_slots for r in batch.rows}
        assert sizes.get("s", 0) < 1024, sizes  # never grown towards the long row's 1100+ slots
    assert out["l"] == solo(target, None, long_, 20, exact=True)
    assert out["s"] == solo(target, None, short, 30, exact=True)
