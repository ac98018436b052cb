"""EAGLE-3 training-time test: the unrolled training forward computes exactly what the
drafter computes at inference, and the objective learns."""

from __future__ import annotations

import pytest
import torch

from eyas.drafters.eagle3 import random_eagle3_head
from eyas.kv.static import KVCache
from eyas.train.eagle3 import Eagle3LossConfig, Eagle3Objective, TTTLayers, shift_left
from eyas.train.features import TargetFeaturizer


def _batch(target, head, n: int = 24, b: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (b, n), generator=g)
    ones = torch.ones(b, n, dtype=torch.bool)
    return TargetFeaturizer(target, head.cfg.aux_layers)(ids, ones, ones)


def _ttt_outputs(head, target, batch, steps: int) -> list[torch.Tensor]:
    """The objective's per-step pre-norm outputs [B, T, H] (same code path as Eagle3Objective.loss)."""
    from eyas.models.native import rope_tables

    emb = target.embed(batch.input_ids)
    b, t = batch.input_ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    layers = TTTLayers(head)
    hid, outs = head.fuse(batch.taps), []
    for k in range(steps):
        hid = layers(shift_left(emb, 1 + k), hid, rope_tables(head.inv_freq, pos + k, emb.dtype))
        outs.append(hid)
    return outs


@torch.no_grad()
@pytest.mark.parametrize("num_layers", (1, 2))
def test_ttt_unroll_equals_inference_chain(tiny, num_layers):
    """Step k at position t == the head run at depth k+1 of a chain drafted from position t (every layer)."""
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=128, seed=2, num_layers=num_layers)
    batch = _batch(target, head, n=20, b=1)
    steps = 4
    outs = _ttt_outputs(head, target, batch, steps)
    ids = batch.input_ids[0]
    c = head.config
    for t in (0, 5, 11):
        cache = KVCache.empty(num_layers, 1, c.num_kv_heads, 64, c.head_dim, torch.float32)
        # committed prefix: slots 0..t hold (embed(x[s+1]), fc(taps[s]))
        emb = target.embed(ids[1 : t + 2][None])
        h = head(emb, head.fuse(batch.taps[:, : t + 1]), torch.arange(t + 1)[None], cache, 0, None)
        assert torch.allclose(h[0, t], outs[0][0, t], atol=1e-5)
        parent = h[:, t : t + 1]
        for k in range(1, steps):
            slot = t + k
            mask = torch.ones(1, 1, slot + 1, dtype=torch.bool)
            tok = ids[t + 1 + k][None, None]
            parent = head(target.embed(tok), parent, torch.tensor([[t + k]]), cache, slot, mask)
            assert torch.allclose(parent[0, 0], outs[k][0, t], atol=1e-5), (t, k)


def test_objective_overfits_a_small_batch(tiny):
    torch.manual_seed(0)
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=256, seed=2).requires_grad_(True).train()
    batch = _batch(target, head, n=16, b=2)
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(40):
        loss, stats = obj.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else stats
    # the floor of a soft cross-entropy is the labels' entropy: compare the excess (a KL) instead
    p, _ = obj.labels(batch)
    floor = sum(0.8**k * float(-(p * p.clamp_min(1e-30).log()).sum(-1)[:, 1 + k :].mean()) for k in range(3))
    assert stats["loss"] - floor < 0.5 * (first["loss"] - floor), (first, stats, floor)
    assert stats["acc0"] > first["acc0"] + 0.3
    assert set(stats) >= {"acc0", "acc1", "acc2", "loss0", "loss"}


def test_tap_scale_folds_into_fc(tiny):
    """Training's fc(taps * scale) equals the exported head's plain fc(taps)."""
    from eyas.train.eagle3 import fit_tap_scale

    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=64, seed=2)
    batch = _batch(target, head, n=12, b=2)
    taps = batch.taps.clone()
    taps[..., 3] *= 1000.0  # a massive-activation channel
    scale = fit_tap_scale(taps.flatten(0, 1))
    assert scale.shape == (taps.shape[-2] * taps.shape[-1],) and scale[3] < 1e-2 * scale[4]
    obj = Eagle3Objective(head, target, tap_scale=scale)
    trained = torch.nn.functional.linear(taps.flatten(-2) * scale, head.fc.weight)
    assert torch.allclose(obj.folded().fuse(taps), trained, rtol=1e-5, atol=1e-5)
    assert torch.equal(obj.module.fc.weight, head.fc.weight)  # folding works on a copy


def test_loss_on_learnable_rows_equals_the_dense_loss(tiny):
    """Logits only where a label is learnable == the dense [B, T, Vd] computation masked afterwards."""
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2).requires_grad_(True)
    batch = _batch(target, head, n=18, b=3)
    g = torch.Generator().manual_seed(5)
    batch.loss_mask = torch.rand(batch.loss_mask.shape, generator=g) < 0.6  # prompt-like gaps
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3))
    loss, stats = obj.loss(batch)
    p, in_vocab = obj.labels(batch)
    valid = batch.loss_mask & in_vocab
    assert 0 < int(valid.sum()) < valid.numel()  # some labels fall outside the draft vocabulary
    ref = torch.zeros(())
    for k, out in enumerate(_ttt_outputs(head, target, batch, 3)):
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, T, Vd]
        m = shift_left(valid, 1 + k, False)
        step = (-(shift_left(p, 1 + k) * logp).sum(-1) * m).sum() / m.sum()
        assert abs(stats[f"loss{k}"] - float(step)) < 1e-4
        ref = ref + 0.8**k * step
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-5)
    grad = torch.autograd.grad(loss, head.fc.weight)[0]
    ref_grad = torch.autograd.grad(ref, head.fc.weight)[0]
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("topk", [64, 96])
def test_griffin_alignment_masks_steps_an_earlier_miss_cannot_reach(tiny, topk):
    """align_topk K: step k counts at t only where steps 0..k-1 at t had a learnable label among their
    top-K drafts (K = 96, the whole draft vocabulary: only where the earlier labels were learnable)."""
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2).requires_grad_(True)
    batch = _batch(target, head, n=18, b=3)
    g = torch.Generator().manual_seed(5)
    batch.loss_mask = torch.rand(batch.loss_mask.shape, generator=g) < 0.8
    draft = head.draft_ids()
    _, plain_stats = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3)).loss(batch)
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3, align_topk=topk))
    loss, stats = obj.loss(batch)
    p, in_vocab = obj.labels(batch)
    valid = batch.loss_mask & in_vocab
    reach, ref, masked, kept = torch.ones_like(valid), torch.zeros(()), [], []
    for k, out in enumerate(_ttt_outputs(head, target, batch, 3)):  # dense reference
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, T, Vd]
        m = shift_left(valid, 1 + k, False) & reach
        masked.append(int((shift_left(valid, 1 + k, False) & ~m).sum()))
        kept.append(int(m.sum()))
        step = (-(shift_left(p, 1 + k) * logp).sum(-1) * m).sum() / m.sum().clamp(min=1)
        assert abs(stats[f"loss{k}"] - float(step)) < 1e-4, k
        ref = ref + 0.8**k * step
        top = draft[logp.topk(topk, dim=-1).indices]  # [B, T, K]
        reach = m & (top == shift_left(batch.target_tokens, 1 + k)[..., None]).any(-1)
    assert masked[0] == 0 and masked[1] > 0 and masked[2] > 0  # later steps lose what earlier ones missed
    assert kept[1] > 0  # ... not everything
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-5)
    assert abs(stats["loss0"] - plain_stats["loss0"]) < 1e-6 and stats["loss2"] != plain_stats["loss2"]


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_label_temperature_sharpens_the_target_distribution(tiny, temperature):
    """label_temperature T: labels softmax(target logits / T) over the draft vocabulary; T = 0 a one-hot label
    on their argmax, so step 0's loss is the head's cross-entropy on the target's top token."""
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2)
    batch = _batch(target, head, n=18, b=2)
    soft, _ = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=2)).labels(batch)
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=2, label_temperature=temperature))
    p, in_vocab = obj.labels(batch)
    if temperature == 0.0:
        ones = torch.ones(p.shape[:-1])
        assert torch.equal(p.sum(-1), ones) and torch.equal(p.max(-1).values, ones)
    else:  # sharper: the top label's probability grows, the distribution's argmax stays
        assert bool((p.max(-1).values > soft.max(-1).values).all())
    assert torch.equal(p.argmax(-1), soft.argmax(-1))
    loss, stats = obj.loss(batch)
    valid = batch.loss_mask & in_vocab
    logp = torch.log_softmax(head.logits(_ttt_outputs(head, target, batch, 1)[0]).float(), dim=-1)
    m = shift_left(valid, 1, False)
    ref = (-(shift_left(p, 1) * logp).sum(-1) * m).sum() / m.sum()
    assert abs(stats["loss0"] - float(ref)) < 1e-4
    _, soft_stats = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=2)).loss(batch)
    assert abs(stats["loss0"] - soft_stats["loss0"]) > 1e-3  # the labels changed the loss


def test_label_temperature_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="label_temperature"):
        Eagle3LossConfig(label_temperature=-1.0)


def test_cli_passes_label_temperature_and_recipe_levers_to_the_run(monkeypatch):
    """`eyas train --label-temperature T --align-topk K` reaches the run's config (the loss reads it there)."""
    import eyas.train.command as command
    from eyas.cli import build_parser

    seen = []
    monkeypatch.setattr(command, "train", seen.append)
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--label-temperature", "0.5",
                                   "--align-topk", "4", "--miss-weight", "1.5"])
    assert a.func(a) == 0
    assert seen[0].label_temperature == 0.5 and seen[0].align_topk == 4 and seen[0].miss_weight == 1.5
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o"])
    a.func(a)
    assert seen[1].label_temperature == 1.0 and seen[1].miss_weight == 0.0  # EAGLE's recipe unless asked
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--label-temperature", "-0.5"])
    with pytest.raises(ValueError, match="--label-temperature"):  # before the target loads
        a.func(a)
    assert len(seen) == 2


def test_miss_weight_weighs_positions_where_the_head_misses(tiny):
    """miss_weight b: each step's loss is the mean of the cross-entropies weighted 1 + b where the head's top-1
    misses the target's token, 1 where it hits; the logged per-step loss stays the unweighted mean."""
    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2).requires_grad_(True)
    batch = _batch(target, head, n=18, b=2)
    fit = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=2))
    opt = torch.optim.AdamW([q for q in head.parameters() if q.requires_grad], lr=3e-3)
    for _ in range(12):  # a head that gets some of the batch right: both kinds of position
        opt.zero_grad()
        fit.loss(batch)[0].backward()
        opt.step()
    _, plain = fit.loss(batch)
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=2, miss_weight=3.0))
    loss, stats = obj.loss(batch)
    p, in_vocab = obj.labels(batch)
    valid = batch.loss_mask & in_vocab
    draft, ref, hits = head.draft_ids(), torch.zeros(()), []
    for k, out in enumerate(_ttt_outputs(head, target, batch, 2)):
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, T, Vd]
        m = shift_left(valid, 1 + k, False)
        ce = -(shift_left(p, 1 + k) * logp).sum(-1)  # [B, T]
        hit = draft[logp.argmax(-1)] == shift_left(batch.target_tokens, 1 + k)
        w = torch.where(hit, 1.0, 4.0) * m
        ref = ref + 0.8**k * (w * ce).sum() / w.sum()
        hits.append(int((hit & m).sum()))
        assert abs(stats[f"loss{k}"] - plain[f"loss{k}"]) < 1e-6
    assert 0 < hits[0] < int(valid[:, 1:].sum())  # both kinds of position present
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    assert abs(float(loss) - plain["loss"]) > 1e-3  # the weights moved it


def test_learnable_rows_are_the_masks_rows():
    """Each step's flat rows == what boolean indexing with its mask selects, in the same order."""
    from eyas.train.eagle3 import learnable_rows

    g = torch.Generator().manual_seed(3)
    valid = torch.rand(3, 17, generator=g) < 0.55
    valid[1] = False  # a row with no label at all
    rows = learnable_rows(valid, 4)
    assert len(rows) == 5
    flat = torch.arange(valid.numel()).view(valid.shape)
    assert torch.equal(rows[0], flat[valid])
    for k in range(4):
        assert torch.equal(rows[1 + k], flat[shift_left(valid, 1 + k, False)]), k
    assert [r.shape[0] for r in learnable_rows(valid, 0)] == [int(valid.sum())]


def test_loss_waits_for_the_device_once(tiny):
    """Without align_topk the loss finds every step's rows with one nonzero and no boolean indexing (each of those
    drains a GPU's queue); align_topk's masks depend on each step's drafts, one nonzero a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nonzero = self.bool_index = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.nonzero.default:
                self.nonzero += 1
            if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default,
                        torch.ops.aten.index_put.default):
                self.bool_index += any(i is not None and i.dtype == torch.bool for i in args[1])
            return func(*args, **kwargs)

    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2).requires_grad_(True)
    batch = _batch(target, head, n=18, b=3)
    for align, nonzero in ((0, 1), (4, 1 + 3)):
        obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3, align_topk=align))
        with Count() as c:
            loss, _ = obj.loss(batch)
        assert c.nonzero == nonzero, (align, c.nonzero)
        if not align:
            assert c.bool_index == 0
        assert torch.isfinite(loss)


@torch.no_grad()
def test_padding_to_a_multiple_leaves_the_loss_unchanged(tiny):
    """collate(..., multiple): the batch is longer (a few shapes for the GPU's attention), the padded positions are
    masked out of attention and loss, so the loss and its statistics are those of the unpadded batch."""
    from eyas.train.dataset import Example, collate

    target = tiny.native("llama", seed=0)
    head = random_eagle3_head(target.config, draft_vocab_size=96, seed=2)
    obj = Eagle3Objective(head, target, Eagle3LossConfig(ttt_steps=3))
    g = torch.Generator().manual_seed(3)
    examples = []
    for n in (13, 9):
        ids = torch.randint(0, target.config.vocab_size, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3 : n - 1] = True
        examples.append(Example(ids, mask))
    featurize = TargetFeaturizer(target, head.cfg.aux_layers)
    results = []
    for multiple in (1, 16):
        b = collate(examples, multiple)
        assert b["input_ids"].shape == (2, 13 if multiple == 1 else 16)
        results.append(obj.loss(featurize(b["input_ids"], b["attention_mask"], b["loss_mask"])))
    (loss1, stats1), (loss16, stats16) = results
    assert torch.allclose(loss1, loss16, atol=1e-5)
    assert stats1.keys() == stats16.keys()
    for k in stats1:
        assert torch.allclose(torch.as_tensor(stats1[k]), torch.as_tensor(stats16[k]), atol=1e-5), k
    with pytest.raises(ValueError, match="multiple"):
        collate(examples, 0)


def test_cli_passes_the_padding_multiple_and_rejects_zero(monkeypatch):
    import eyas.train.command as command
    from eyas.cli import build_parser

    seen = []
    monkeypatch.setattr(command, "train", seen.append)
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--pad-multiple", "64"])
    assert a.func(a) == 0 and seen[0].pad_multiple == 64
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o"])
    assert a.func(a) == 0 and seen[1].pad_multiple == 1  # pad to the longest only, unless asked
    a = build_parser().parse_args(["train", "--data", "d.jsonl", "--out", "o", "--pad-multiple", "0"])
    with pytest.raises(ValueError, match="--pad-multiple"):
        a.func(a)
