"""``eyas train --grow-draft-vocab``: a continued EAGLE-3 head over a larger draft vocabulary, its own ids' logits
unchanged and the new rows mapped from the target's."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.cli import main
from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.train.eagle3 import grow_draft_vocab
from tests.conftest import tiny_native
from tests.formats.test_eagle3_format import make_head


def _grown(extra: int = 40, seed: int = 0):
    cfg = tiny_native("llama").config
    head = make_head(cfg)
    old = head.draft_ids()
    g = torch.Generator().manual_seed(seed)
    target_rows = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    fit = torch.randn(cfg.hidden_size, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
    with torch.no_grad():  # the head's rows: the target's through a known map, so the fit must find that map
        head.lm_head.weight.copy_(target_rows[old] @ fit)
    others = torch.tensor([i for i in range(cfg.vocab_size) if i not in set(old.tolist())])
    new = others[torch.randperm(others.shape[0], generator=g)[:extra]]
    ids = torch.cat([old, new]).sort().values
    return cfg, head, old, ids, target_rows, fit


def test_grown_head_keeps_its_logits_and_maps_the_new_rows(tmp_path):
    cfg, head, old, ids, target_rows, fit = _grown()
    x = torch.randn(3, cfg.hidden_size)
    before = head.logits(x)  # [3, Vd]
    before_rows = head.lm_head.weight.clone()
    grown = grow_draft_vocab(head, target_rows, ids)
    assert grown.cfg.draft_vocab_size == ids.shape[0] and grown.lm_head.weight.shape == (ids.shape[0], cfg.hidden_size)
    assert torch.equal(grown.draft_ids(), ids)
    assert int(grown.t2d.sum()) == ids.shape[0] and bool(grown.t2d[ids].all())
    at_old = torch.searchsorted(ids, old)
    assert torch.equal(grown.lm_head.weight[at_old], before_rows)  # the current ids' rows, exactly
    assert torch.equal(grown.logits(x)[:, at_old], before)  # so their logits too
    is_new = torch.ones(ids.shape[0], dtype=torch.bool)
    is_new[at_old] = False
    torch.testing.assert_close(grown.lm_head.weight[is_new], target_rows[ids[is_new]] @ fit, rtol=1e-3, atol=1e-4)
    # the export says the new size, and the engines' loader path reads the vocabulary back
    save_eagle3(grown, tmp_path / "grown", target_name="tiny")
    back = load_eagle3(tmp_path / "grown", cfg)
    assert back.cfg.draft_vocab_size == ids.shape[0] and torch.equal(back.draft_ids(), ids)
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["draft_vocab_size"] == ids.shape[0]


def test_grow_draft_vocab_only_grows():
    cfg, head, old, ids, target_rows, _ = _grown()
    assert grow_draft_vocab(head, target_rows, old) is head  # the same ids: nothing to do
    with pytest.raises(ValueError, match="only grows"):
        grow_draft_vocab(head, target_rows, ids[ids != old[0]])  # one of the head's ids dropped
    with pytest.raises(ValueError, match="only grows"):
        grow_draft_vocab(head, target_rows, old[:-1])


def test_grow_draft_vocab_needs_an_init_head(tmp_path, capsys):
    assert main(["train", "--data", "x.jsonl", "--out", str(tmp_path), "--grow-draft-vocab", "16384"]) != 0
    assert "--grow-draft-vocab grows the head given by --init-head" in capsys.readouterr().err


@pytest.mark.slow
def test_train_grows_the_init_head_and_drafts_losslessly(default_target, tmp_path, capsys):
    from safetensors.torch import load_file

    from tests.train.test_train_continue import _args, _data

    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    assert main(_args(data, tmp_path / "a", 1)) == 0  # a 256-id head
    base = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    run = _args(data, tmp_path / "b", 1, "--init-head", str(tmp_path / "a" / "head"), "--grow-draft-vocab", "300")
    assert main(run) == 0
    grown = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert grown["lm_head.weight"].shape[0] == 300 and base["lm_head.weight"].shape[0] == 256
    ids = torch.arange(300) + grown["d2t"]
    assert bool(torch.isin(torch.arange(256) + base["d2t"], ids).all())  # every earlier id kept
    capsys.readouterr()
    common = ["--max-new-tokens", "24", "--dtype", "float32", "--json"]
    prompt = "What is the capital of France?"
    assert main(["generate", prompt, "--drafter", "none", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", prompt, "--drafter", str(tmp_path / "b" / "head"), *common]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
