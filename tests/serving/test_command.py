"""``eyas serve`` argument parsing and its user errors (no server is started)."""

from __future__ import annotations

import argparse

import pytest

from eyas.serving.command import add_serve_parser, cmd_serve, http_config, served_name


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eyas")
    add_serve_parser(p.add_subparsers(dest="cmd", required=True))
    return p.parse_args(["serve", *argv])


def test_defaults():
    a = _parse()
    assert (a.model, a.drafter, a.host, a.port, a.max_queue) == (None, "default", "127.0.0.1", 8000, 64)
    assert a.func is cmd_serve


def test_flags():
    a = _parse(
        "--model",
        "m.gguf",
        "--drafter",
        "ngram",
        "--tree",
        "chain:4",
        "--dtype",
        "float32",
        "--port",
        "0",
        "--max-queue",
        "3",
        "--max-tokens-limit",
        "32",
        "--max-prompt-tokens",
        "100",
    )
    assert (a.tree, a.dtype, a.port, a.max_queue, a.max_tokens_limit, a.max_prompt_tokens) == (
        "chain:4",
        "float32",
        0,
        3,
        32,
        100,
    )


def test_batching_flags():
    a = _parse()
    assert (a.max_batch, a.spec_policy, a.no_calibrate) == (8, "auto", False)
    a = _parse("--max-batch", "16", "--spec-policy", "never", "--no-calibrate")
    assert (a.max_batch, a.spec_policy, a.no_calibrate) == (16, "never", True)


@pytest.mark.parametrize("flag", ["--max-queue", "--max-tokens-limit", "--max-prompt-tokens", "--max-batch"])
def test_non_positive_limits_are_user_errors(flag):
    with pytest.raises(ValueError, match=flag):
        cmd_serve(_parse(flag, "0"))


def test_prefix_cache_flag():
    assert _parse().prefix_cache_mb == 256
    assert _parse("--prefix-cache-mb", "0").prefix_cache_mb == 0
    with pytest.raises(ValueError, match="--prefix-cache-mb must be >= 0"):
        cmd_serve(_parse("--prefix-cache-mb", "-1"))


def test_load_refuses_a_negative_prefix_cache():
    import eyas

    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0"):
        eyas.load(prefix_cache_mb=-5)


def test_served_name(tmp_path):
    assert served_name(None) == "SmolLM2-135M-Instruct"
    assert served_name("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"
    (tmp_path / "Llama-3.1-8B-Instruct").mkdir()
    (tmp_path / "smol.q8.gguf").write_bytes(b"")
    assert served_name(str(tmp_path / "Llama-3.1-8B-Instruct") + "/") == "Llama-3.1-8B-Instruct"
    assert served_name(str(tmp_path / "smol.q8.gguf")) == "smol.q8"


def test_http_flags_and_api_key_env(monkeypatch):
    monkeypatch.delenv("EYAS_API_KEY", raising=False)
    h = http_config(_parse())
    assert (h.max_body_bytes, h.body_timeout_s, h.api_key) == (2 << 20, 30.0, None)
    h = http_config(_parse("--max-body-bytes", "5000", "--body-timeout", "2.5", "--api-key", "k1"))
    assert (h.max_body_bytes, h.body_timeout_s, h.api_key) == (5000, 2.5, "k1")
    monkeypatch.setenv("EYAS_API_KEY", "from-env")
    assert http_config(_parse()).api_key == "from-env"
    assert http_config(_parse("--api-key", "flag")).api_key == "flag"  # the flag wins


@pytest.mark.parametrize("flags", [("--max-body-bytes", "0"), ("--body-timeout", "0"), ("--body-timeout", "-1")])
def test_bad_http_flags_are_user_errors(flags):
    with pytest.raises(ValueError, match=flags[0]):
        cmd_serve(_parse(*flags))


def test_the_model_is_built_off_the_main_thread():
    """The main thread must not open an OpenMP pool (eyas.serving.command.off_main_thread): the builder runs in
    a thread of its own that has ended when the result comes back, and its errors reach the caller."""
    import threading

    from eyas.serving.command import off_main_thread

    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return "app"

    assert off_main_thread(build) == "app"
    assert seen["thread"] is not threading.main_thread() and not seen["thread"].is_alive()

    def bad():
        raise ValueError("drafter path 'x' does not exist")

    with pytest.raises(ValueError, match="does not exist"):
        off_main_thread(bad)
