"""The offline feature cache returns what the online featurizer returns, calls the target once
per example, and survives reuse mistakes and killed writes."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.train.cache import FeatureCache
from eyas.train.dataset import Example, collate
from eyas.train.features import FeatureBatch, TargetFeaturizer

LENGTHS = (5, 17, 9, 30, 12)


class Counting(TargetFeaturizer):
    """A featurizer that counts target forwards and the examples they covered."""

    def __init__(self, target, tap_layers=()) -> None:
        super().__init__(target, tap_layers)
        self.calls = 0
        self.rows = 0

    def __call__(self, input_ids, attention_mask, loss_mask) -> FeatureBatch:
        self.calls += 1
        self.rows += input_ids.shape[0]
        return super().__call__(input_ids, attention_mask, loss_mask)


def _examples(seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        loss = torch.rand(n, generator=g) < 0.5
        out.append(Example(torch.randint(0, 256, (n,), generator=g), loss, f"conv:{i}"))
    return out


def _online(f: TargetFeaturizer, batch: list[Example]) -> FeatureBatch:
    b = collate(batch)
    return f(b["input_ids"], b["attention_mask"], b["loss_mask"])


def _assert_same(got: FeatureBatch, want: FeatureBatch, atol: float = 0.0) -> None:
    """Equal on real positions (exactly when atol == 0); the cache's padding rows are zero."""
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    real = want.attention_mask
    for name in ("hidden", "taps", "target_tokens"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if atol == 0.0 or name == "target_tokens":
            assert torch.equal(g[real], w[real]), name
        else:
            torch.testing.assert_close(g[real], w[real], atol=atol, rtol=0)
        assert not g[~real].any(), name


def test_first_epoch_matches_online_later_epochs_only_read(tiny, tmp_path):
    target = tiny.native("llama", seed=0)
    online = TargetFeaturizer(target, (0, 2))
    exs = _examples()
    f = Counting(target, (0, 2))
    cache = FeatureCache(tmp_path, f)
    filled = {}  # id -> (hidden [T, D], taps [T, L, D]) as the filling forward computed them
    for batch in ([exs[0], exs[1]], [exs[2], exs[3], exs[4]]):
        got = cache(batch)  # filling: one target forward over the batch the online path runs
        _assert_same(got, _online(online, batch))
        for i, e in enumerate(batch):
            filled[e.id] = (got.hidden[i, : len(e.input_ids)], got.taps[i, : len(e.input_ids)])
    assert (f.calls, cache.computed, len(cache)) == (2, 5, 5)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["tap_layers"] == [0, 2] and meta["dtype"] == "float32" and meta["hidden_size"] == 64
    shards = sorted(p.name for p in tmp_path.glob("shard_*"))
    assert shards == ["shard_00000.safetensors", "shard_00001.safetensors"]

    # a later epoch (a new process: a fresh object) with other batches only reads, one shard open at a time
    f2 = Counting(target, (0, 2))
    cache2 = FeatureCache(tmp_path, f2, max_open=1)
    for batch in ([exs[4], exs[0]], [exs[3], exs[1], exs[2]]):
        got = cache2(batch)
        assert len(cache2._open) == 1
        for i, e in enumerate(batch):  # bit-exact copies of the filling forward's features
            assert torch.equal(got.hidden[i, : len(e.input_ids)], filled[e.id][0])
            assert torch.equal(got.taps[i, : len(e.input_ids)], filled[e.id][1])
        # the online featurizer on this other batch agrees up to fp32 batching/padding rounding (~2e-6)
        _assert_same(got, _online(online, batch), atol=1e-5)
    assert (f2.calls, cache2.read) == (0, 5)


def test_changed_example_is_recomputed(tiny, tmp_path):
    target = tiny.native("llama", seed=0)
    exs = _examples()
    f = Counting(target, (1,))
    cache = FeatureCache(tmp_path, f)
    cache(exs)
    edited = Example(exs[1].input_ids.flip(0), exs[1].loss_mask, exs[1].id)  # same id, new tokens
    batch = [exs[0], edited, exs[2]]
    got = cache(batch)
    assert (f.calls, f.rows) == (2, len(exs) + 1)  # only the edited example went through the target
    want = _online(TargetFeaturizer(target, (1,)), [edited])
    n = len(edited.input_ids)
    assert torch.equal(got.hidden[1, :n], want.hidden[0]) and torch.equal(got.taps[1, :n], want.taps[0])
    f.calls = 0
    FeatureCache(tmp_path, f)(batch)  # and the new version is what a restart finds
    assert f.calls == 0


def test_no_taps(tiny, tmp_path):
    target = tiny.native("llama", seed=0)
    exs = _examples()[:3]
    cache = FeatureCache(tmp_path, TargetFeaturizer(target))
    cache(exs)
    got = FeatureCache(tmp_path, TargetFeaturizer(target))(exs)
    assert got.taps.shape == (3, max(LENGTHS[:3]), 0, 64)
    _assert_same(got, _online(TargetFeaturizer(target), exs))


def test_cache_for_another_target_is_refused(tiny, tmp_path):
    target = tiny.native("llama", seed=0)
    FeatureCache(tmp_path, TargetFeaturizer(target, (0, 2)))(_examples()[:2])
    with pytest.raises(ValueError, match=r"tap_layers \[1\] \(cache: \[0, 2\]\).*delete"):
        FeatureCache(tmp_path, TargetFeaturizer(target, (1,)))
    with pytest.raises(ValueError, match="weights"):  # same architecture, other checkpoint
        FeatureCache(tmp_path, TargetFeaturizer(tiny.native("llama", seed=3), (0, 2)))
    with pytest.raises(ValueError, match="dtype 'bfloat16'"):
        FeatureCache(tmp_path, TargetFeaturizer(target.to(torch.bfloat16), (0, 2)))


def test_killed_write_leftovers_are_ignored(tiny, tmp_path):
    target = tiny.native("llama", seed=0)
    exs = _examples()
    f = Counting(target, (0,))
    FeatureCache(tmp_path, f)(exs[:2])
    good = (tmp_path / "shard_00000.safetensors").read_bytes()
    # killed mid-save: half a shard under its temporary name
    (tmp_path / "shard-999-deadbeef.safetensors.tmp").write_bytes(good[: len(good) // 2])
    # killed after the rename, before the index append: a complete shard no index line names
    (tmp_path / "shard_00001.safetensors").write_bytes(good)
    # killed mid-append (torn line), e.g. on a crash of the machine
    with (tmp_path / "index.jsonl").open("a") as fh:
        fh.write('{"id": "conv:2", "hash": "ab')
    f.calls = f.rows = 0
    cache = FeatureCache(tmp_path, f)
    assert len(cache) == 2
    got = cache(exs)
    assert (f.calls, f.rows) == (1, 3)  # conv:2..4 computed, conv:0..1 read
    assert (tmp_path / "shard_00002.safetensors").exists()  # the orphan's name was not reused
    f.calls = 0
    again = FeatureCache(tmp_path, f)(exs)  # the torn line did not swallow the appended block
    assert f.calls == 0 and len(FeatureCache(tmp_path, f)) == 5
    _assert_same(again, got)


def test_two_writers_share_a_directory(tiny, tmp_path):
    """DDP ranks fill one cache: names never collide and each rank sees the other's examples."""
    target = tiny.native("llama", seed=0)
    exs = _examples()
    fa, fb = Counting(target, (0,)), Counting(target, (0,))
    a, b = FeatureCache(tmp_path, fa), FeatureCache(tmp_path, fb)
    a(exs[:2])
    b(exs[2:])
    b(exs[:2])  # written by the other rank after b was opened
    a(exs[1:])
    assert (fa.calls, fb.calls) == (1, 1)
    assert len(list(tmp_path.glob("shard_*.safetensors"))) == 2
