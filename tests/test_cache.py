"""The GGUF conversion cache is keyed by content, and `eyas cache` lists and removes what is cached."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from eyas import cache
from eyas.cli import main
from eyas.models import loading


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    r = tmp_path / "cache"
    monkeypatch.setenv("EYAS_CACHE", str(r))
    return r


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Stands in for the ~20 s transformers conversion: records each call, writes a marker directory."""
    made: list[Path] = []

    def fake(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(gguf.read_bytes())
        made.append(gguf)

    monkeypatch.setattr(loading, "_convert_gguf", fake)
    return made


def _gguf(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_copies_of_one_file_share_a_conversion(tmp_path, root, conversions):
    a = _gguf(tmp_path / "venv1" / "m.gguf", b"GGUF same bytes")
    b = _gguf(tmp_path / "venv2" / "m.gguf", b"GGUF same bytes")
    da, db = loading.gguf_to_dir(a), loading.gguf_to_dir(b)
    assert da == db == root / f"m-{hashlib.sha256(b'GGUF same bytes').hexdigest()[:16]}"
    assert conversions == [a]
    assert json.loads((da / "source.json").read_text())["sources"] == [str(a.resolve()), str(b.resolve())]
    other = loading.gguf_to_dir(_gguf(tmp_path / "venv3" / "m.gguf", b"GGUF other bytes"))
    assert other != da and len(conversions) == 2


def test_a_path_is_hashed_once_until_the_file_changes(tmp_path, root, conversions, monkeypatch):
    calls = []
    real = hashlib.file_digest

    def counting(f, name):
        calls.append(name)
        return real(f, name)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    g = _gguf(tmp_path / "m.gguf", b"GGUF v1")
    first = loading.gguf_to_dir(g)
    assert loading.gguf_to_dir(g) == first and len(calls) == 1
    g.write_bytes(b"GGUF v2, rewritten")
    os.utime(g, ns=(1, 1))  # a different mtime as well as size
    assert loading.gguf_to_dir(g) != first and len(calls) == 2


def test_a_read_only_cache_still_serves_what_it_holds(tmp_path, root, conversions, monkeypatch):
    """A prepared, read-only cache (an image's): the digest stamp, the source list and a kernel build's mark cannot
    be written, and what the cache holds is used all the same. (File modes do not stop root, so writes under the
    cache are refused by hand.)"""
    from eyas import kernels

    g = _gguf(tmp_path / "m.gguf", b"GGUF baked in")
    d = loading.gguf_to_dir(g)

    def refuse(real):
        def method(self, *a, **kw):
            if root in self.parents:
                raise PermissionError(13, "Read-only file system", str(self))
            return real(self, *a, **kw)
        return method

    for name in ("write_text", "mkdir", "touch"):
        monkeypatch.setattr(Path, name, refuse(getattr(Path, name)))
    other = _gguf(tmp_path / "copy" / "m.gguf", b"GGUF baked in")  # not in the stamps or the source list
    assert loading.gguf_to_dir(other) == d and conversions == [g]
    kernels._stamp(root / "kernels" / "x" / "last_used")  # no error


def test_a_path_keyed_conversion_is_renamed_not_remade(tmp_path, root, conversions):
    g = _gguf(tmp_path / "m.gguf", b"GGUF legacy")
    legacy = root / f"m-{loading._stat_key(g)}"
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"weights")
    d = loading.gguf_to_dir(g)
    assert conversions == [] and not legacy.exists() and (d / "model.safetensors").read_bytes() == b"weights"


def _conversion(root: Path, name: str, sources: list[str] | None, done: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if done:
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    if sources is not None:
        (d / "source.json").write_text(json.dumps({"sha256": "0", "sources": sources}))
    return d


def test_purge_stale_keeps_what_a_file_still_needs(tmp_path, root, capsys):
    live = _gguf(tmp_path / "live.gguf", b"GGUF")
    keep = _conversion(root, "live-aaaa", [str(tmp_path / "gone.gguf"), str(live)])
    gone = _conversion(root, "gone-bbbb", [str(tmp_path / "gone.gguf")])
    legacy = _conversion(root, "old-cccc", None)
    partial = _conversion(root, "p-dddd.123.tmp", None, done=False)
    os.utime(partial, (0, 0))  # written long ago: a conversion that died
    running = _conversion(root, "q-eeee.456.tmp", None, done=False)  # just now: another process may be converting
    (root / "tree_costs").mkdir()
    (root / "tree_costs" / "k.json").write_text("{}")
    (root / "notes.txt").write_text("not ours")
    kinds = {e.path.name: (e.kind, bool(e.stale)) for e in cache.entries(root)}
    assert kinds == {"live-aaaa": ("conversions", False), "gone-bbbb": ("conversions", True),
                     "old-cccc": ("conversions", True), "p-dddd.123.tmp": ("conversions", True),
                     "q-eeee.456.tmp": ("conversions", False), "tree_costs": ("timings", False)}
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "conversions: 5 entries" in out and "its GGUF files are gone" in out and str(live) in out
    assert main(["cache", "purge", "--stale"]) == 0
    assert keep.exists() and running.exists()
    assert not gone.exists() and not legacy.exists() and not partial.exists()
    assert (root / "tree_costs").exists() and (root / "notes.txt").exists()


def test_purge_one_kind_or_everything(root):
    _conversion(root, "m-aaaa", [])
    (root / "kernel_tuning").mkdir()
    (root / "row_floors.json").write_text("{}")
    assert main(["cache", "purge", "--only", "timings"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["m-aaaa"]
    assert main(["cache", "purge"]) == 0
    assert list(root.iterdir()) == []


def test_info_on_a_missing_cache(root, capsys):
    assert main(["cache"]) == 0
    assert "total 0.0 MB" in capsys.readouterr().out


def _kernel_build(root: Path, name: str, torch_dir: Path, built: bool = True, used: float | None = None) -> Path:
    d = root / "kernels" / name
    (d / "src").mkdir(parents=True)
    inc = torch_dir / "include"
    (d / "build.ninja").write_text(f"ninja_required_version = 1.3\ncxx = c++\n\ncflags = -DTORCH_EXTENSION_NAME=x "
                                   f"-isystem {inc} -isystem {inc}/torch/csrc/api/include\n")
    if built:
        (d / "eyas_x.so").write_bytes(b"\0" * 100)
        (d / "last_used").touch()
        if used is not None:
            os.utime(d / "last_used", (used, used))
    return d


def test_purge_stale_kernel_builds(tmp_path, root, capsys):
    """Builds for a torch install that is gone, not loaded for 30 days, or left unfinished go; the rest stay."""
    torch_dir = tmp_path / "venv" / "torch"
    (torch_dir / "include").mkdir(parents=True)
    kept = _kernel_build(root, "a", torch_dir)
    gone = _kernel_build(root, "b", tmp_path / "deleted-venv" / "torch")
    idle = _kernel_build(root, "c", torch_dir, used=time.time() - 31 * 86400)
    dead = _kernel_build(root, "d", torch_dir, built=False)
    os.utime(dead, (0, 0))
    building = _kernel_build(root, "e", torch_dir, built=False)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "kernels: 5 entries" in out and "2 kernel builds kept" in out
    assert "1 kernel builds stale: built for a torch install that is gone" in out
    assert main(["cache", "purge", "--stale"]) == 0
    assert "removed 3 kernel builds" in capsys.readouterr().out
    assert kept.exists() and building.exists() and not gone.exists() and not idle.exists() and not dead.exists()


def test_a_kernel_load_stamps_its_build(tmp_path):
    """eyas.kernels marks each build it loads, so purge --stale keeps the ones in use (the real build, cached)."""
    from eyas import kernels

    if kernels.rms_norm() is None:
        pytest.skip("no C++ toolchain: nothing is built")
    stamp = kernels._build_dir(kernels._HERE / "rms_norm.cpp") / "last_used"
    assert stamp.exists() and time.time() - stamp.stat().st_mtime < 24 * 3600


def test_purge_stale_drops_the_hashes_of_files_gone_or_changed(tmp_path, root, conversions):
    kept, moved, rewritten = (_gguf(tmp_path / f"{n}.gguf", f"GGUF {n}".encode()) for n in ("a", "b", "c"))
    for g in (kept, moved, rewritten):
        loading.gguf_to_dir(g)
    moved.rename(tmp_path / "elsewhere.gguf")
    rewritten.write_bytes(b"GGUF c, a new version")
    stamps = root / "gguf_digests"
    assert sum(e.stale != "" for e in cache.entries(root) if e.path.parent == stamps) == 2
    assert main(["cache", "purge", "--stale"]) == 0
    (left,) = stamps.iterdir()
    assert loading.digest_stamp_current(left) and left.name == loading._stat_key(kept)
