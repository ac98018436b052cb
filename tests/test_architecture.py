"""Architecture test against regrowth (style.md rule 14 and section 4).

Import direction, where ``A <- B`` means B may import A:

    types  <-  tree, verify, kv  <-  models, drafters  <-  decode, api  <-  serving, training, bench, cli

Every module under ``eyas/`` is parsed with ``ast`` (nothing is imported), its ``eyas.*`` imports
are collected (absolute, ``from eyas import x`` and relative, including imports inside functions
and ``TYPE_CHECKING`` blocks), and each one is checked against ``LAYERS``: a module may import
its own layer or a lower one, never a higher one.

A new top-level module or subpackage that is not in ``LAYERS`` counts as a layer-0 helper only
while it imports nothing from ``eyas``; once it does, classify it in ``LAYERS`` below.

The second test enforces the module size budget of style.md rule 10; the last one runs ruff.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "eyas"

# Top-level name under eyas/ (module ``eyas/x.py`` or subpackage ``eyas/x/``) -> layer.
LAYERS: dict[str, int] = {
    "types": 0,
    "tree": 1,
    "verify": 1,
    "kv": 1,
    "models": 2,
    # compiled CPU kernels (exact mode's tree attention), built on first use; the native model calls them
    "kernels": 2,
    "drafters": 2,
    # tau of every EAGLE-2 tree shape, replaying a drafter over greedy texts (the sizer's measured profile)
    "tree_replay": 2,
    # checkpoint layouts of other engines (EAGLE-1/3, Medusa, speculators) <-> eyas heads
    "formats": 2,
    "decode": 3,
    # continuous batching over SpecDecoder rows, and its speculation-by-load policy
    "batch": 3,
    "policy": 3,
    "api": 3,
    # a draft tree sized to the machine at load (measures through decode, chooses with tree.sizing)
    "autotree": 3,
    "generation": 3,
    # Run config composing the component dataclasses (style.md section 4, rule 1).
    "config": 3,
    # The package root is the public facade (load(), SpecDecoder, config classes), so
    # ``from eyas import X`` counts as an import of the API layer.
    "__init__": 3,
    "serving": 4,
    "training": 4,
    "train": 4,
    "data": 4,
    "bench": 4,
    # `eyas cache`: lists and removes what models (conversions, timings) and kernels keep on disk
    "cache": 4,
    "cli": 4,
    "__main__": 4,
}

MAX_LINES = 450
# style.md rule 10 exempts CLI ``main``; the CLI module still gets a ceiling.
MAX_LINES_EXEMPT = {"cli": 600}


def module_name(path: Path) -> str:
    """Dotted name of a file under ``PACKAGE_DIR``: eyas/tree/static.py -> eyas.tree.static."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_submodule(dotted: str) -> bool:
    """Whether ``eyas.a.b`` names a module or package on disk."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    target = PACKAGE_DIR / rel
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def eyas_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted target) for every import of an ``eyas`` module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    this = module_name(path)
    # The package a relative import starts from: the module itself for an __init__.py.
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "eyas"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] != "eyas":
                continue
            for alias in node.names:
                # `from eyas.tree import static` imports the submodule eyas.tree.static.
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if is_submodule(candidate) else base))
    return found


def layer_key(dotted: str) -> str:
    """The ``LAYERS`` key of a dotted eyas module: eyas.tree.static -> tree, eyas -> __init__."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def python_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def test_package_is_found() -> None:
    names = {module_name(p) for p in python_files()}
    assert {"eyas", "eyas.types"} <= names, f"scan of {PACKAGE_DIR} found {sorted(names)}"


def test_import_direction() -> None:
    problems: list[str] = []
    for path in python_files():
        rel = path.relative_to(PACKAGE_DIR.parent)
        key = layer_key(module_name(path))
        imports = eyas_imports(path)
        if key not in LAYERS:
            if imports:
                problems.append(
                    f"{rel}: top-level module '{key}' is not classified but imports "
                    f"{sorted({t for _, t in imports})}; add '{key}' to LAYERS in {Path(__file__).name}"
                )
            continue
        for line, target in imports:
            target_key = layer_key(target)
            # An unclassified target is a layer-0 helper; its own check rejects it if it imports eyas.
            target_layer = LAYERS.get(target_key, 0)
            if target_layer > LAYERS[key]:
                problems.append(
                    f"{rel}:{line}: '{key}' (layer {LAYERS[key]}) imports {target} "
                    f"('{target_key}', layer {target_layer}); lower layers must not import higher ones"
                )
    assert not problems, "import direction violated (style.md section 4):\n" + "\n".join(problems)


def test_module_size_budget() -> None:
    problems: list[str] = []
    for path in python_files():
        limit = MAX_LINES_EXEMPT.get(layer_key(module_name(path)), MAX_LINES)
        n_lines = len(path.read_text(encoding="utf-8").splitlines())
        if n_lines > limit:
            problems.append(f"{path.relative_to(PACKAGE_DIR.parent)}: {n_lines} lines > {limit}")
    assert not problems, (
        "module size budget exceeded (style.md rule 10, ~400 lines; split the module):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize(
    ("source", "filename", "expected"),
    [
        ("from eyas.types import Tree", "tree/x.py", ["eyas.types"]),
        ("import eyas.kv.static", "models/x.py", ["eyas.kv.static"]),
        ("from eyas.tree import static", "decode.py", ["eyas.tree.static"]),
        ("from eyas import types", "kv/x.py", ["eyas.types"]),
        ("from eyas import SpecDecoder", "kv/x.py", ["eyas"]),
        ("from . import build", "tree/x.py", ["eyas.tree.build"]),
        ("from ..types import Tree", "tree/x.py", ["eyas.types"]),
        ("from .static import KVCache", "kv/__init__.py", ["eyas.kv.static"]),
        ("def f():\n    from eyas.decode import x", "tree/x.py", ["eyas.decode"]),
        ("import torch\nfrom torch import nn", "tree/x.py", []),
    ],
)
def test_import_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, filename: str, expected: list[str]
) -> None:
    # A throwaway package with the real layout's names, so submodule lookups resolve.
    pkg = tmp_path / "eyas"
    for rel in [
        "__init__.py",
        "types.py",
        "decode.py",
        "tree/__init__.py",
        "tree/build.py",
        "tree/static.py",
        "kv/__init__.py",
        "kv/static.py",
        "models/__init__.py",
    ]:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).touch()
    (pkg / filename).write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE_DIR", pkg)
    assert [t for _, t in eyas_imports(pkg / filename)] == expected


def test_ruff_is_clean() -> None:
    """The linter configured in pyproject.toml passes on the whole tree (CI runs it through this test)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (scripts/setup.sh installs it with the dev extras)")
    cmd = [ruff, "check", "--output-format", "concise", "."]
    res = subprocess.run(cmd, cwd=PACKAGE_DIR.parent, capture_output=True, text=True)
    assert res.returncode == 0, f"ruff check found problems:\n{res.stdout}{res.stderr}"
