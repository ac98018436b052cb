"""``eyas train --widen-mlp``: a continued EAGLE-3 head gets a wider MLP that computes the same function."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.cli import main
from eyas.drafters.eagle3 import Eagle3Head
from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.models.config import ModelConfig
from eyas.train.eagle3 import widen_mlp
from tests.conftest import tiny_native
from tests.formats.test_eagle3_format import make_head


def _head() -> tuple[Eagle3Head, ModelConfig]:
    cfg = tiny_native("llama").config
    return make_head(cfg), cfg


def _mlp_block(head: Eagle3Head, x: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
    """The layer after attention (residual + MLP) and the vocabulary head: what widening touches."""
    return head.lm_head(head.norm(head.midlayer.finish(hid, x)))


def test_widened_head_computes_the_same_function_and_grows_only_the_mlp(tmp_path):
    head, cfg = _head()
    old = {k: v.clone() for k, v in head.state_dict().items()}
    inner = cfg.intermediate_size
    g = torch.Generator().manual_seed(1)
    x, hid = torch.randn(2, 5, cfg.hidden_size, generator=g), torch.randn(2, 5, cfg.hidden_size, generator=g)
    before = _mlp_block(head, x, hid)
    wide = widen_mlp(head, 3 * inner, seed=0)
    assert wide.cfg.model.intermediate_size == 3 * inner and wide.config.intermediate_size == 3 * inner
    sd = wide.state_dict()
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (3 * inner, cfg.hidden_size)
    assert sd["midlayer.mlp.down_proj.weight"].shape == (cfg.hidden_size, 3 * inner)
    # the new units are live (non-zero inputs) but contribute nothing yet (zero output columns)
    for name in ("gate_proj", "up_proj"):
        new = sd[f"midlayer.mlp.{name}.weight"][inner:]
        assert float(new.std()) == pytest.approx(float(old[f"midlayer.mlp.{name}.weight"].std()), rel=0.2)
    assert not sd["midlayer.mlp.down_proj.weight"][:, inner:].any()
    for k, v in old.items():  # every other tensor untouched, the old units' weights kept
        w = sd[k]
        if k.startswith("midlayer.mlp.down_proj"):
            w = w[:, :inner]
        elif k.startswith("midlayer.mlp."):
            w = w[:inner]
        assert torch.equal(w, v), k
    torch.testing.assert_close(_mlp_block(wide, x, hid), before, rtol=0, atol=1e-6)
    # the export says the new width, and the engines' loader path reads it back
    save_eagle3(wide, tmp_path / "wide", target_name="tiny")
    back = load_eagle3(tmp_path / "wide", cfg)
    assert back.cfg.model.intermediate_size == 3 * inner
    down = sd["midlayer.mlp.down_proj.weight"].to(torch.bfloat16).float()  # exported in bf16
    assert torch.equal(back.state_dict()["midlayer.mlp.down_proj.weight"], down)


def test_widen_mlp_only_widens():
    head, cfg = _head()
    assert widen_mlp(head, cfg.intermediate_size) is head
    with pytest.raises(ValueError, match="only widens"):
        widen_mlp(head, cfg.intermediate_size - 1)


def test_widen_mlp_needs_an_init_head(tmp_path, capsys):
    assert main(["train", "--data", "x.jsonl", "--out", str(tmp_path), "--widen-mlp", "4096"]) != 0
    assert "--widen-mlp widens the head given by --init-head" in capsys.readouterr().err


@pytest.mark.slow
def test_train_widens_the_init_head_and_resumes_at_its_width(default_target, tmp_path):
    from safetensors.torch import load_file

    from tests.train.test_train_continue import _args, _data

    data = _data(tmp_path / "a.jsonl", "A short answer to: {}")
    assert main(_args(data, tmp_path / "a", 2)) == 0
    base = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    inner = base["midlayer.mlp.down_proj.weight"].shape[1]
    run = _args(data, tmp_path / "b", 2, "--init-head", str(tmp_path / "a" / "head"), "--widen-mlp", str(2 * inner),
                "--save-every", "1")
    assert main(run) == 0
    wide = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert wide["midlayer.mlp.down_proj.weight"].shape[1] == 2 * inner
    assert wide["midlayer.mlp.down_proj.weight"][:, inner:].any()  # trained: the new units now contribute
    # a resumed run rebuilds the widened head before reading its checkpoint
    assert main(run[:run.index("--max-steps") + 1] + ["3"] + run[run.index("--max-steps") + 2 :]) == 0
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 3
    again = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert again["midlayer.mlp.down_proj.weight"].shape[1] == 2 * inner
