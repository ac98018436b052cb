"""Where the compiled kernels are built: a directory keyed by the sources' content, the CPU and the torch install,
holding its own copy of the sources, so that another checkout (or the installed copy) of the same sources reuses
the build instead of having ninja rebuild it for a new source path; and the one-time notes builds and timings print.
"""

from __future__ import annotations

import os

from eyas import kernels


def test_the_build_compiles_its_own_copy_of_the_sources(tmp_path):
    source = kernels._HERE / "gguf_f32.cpp"
    copy = kernels._stable_copy(source, tmp_path)
    assert copy == tmp_path / "src" / "gguf_f32.cpp"
    assert copy.read_bytes() == source.read_bytes()
    for header in kernels._HERE.glob("*.h"):  # included by name, beside the source
        assert (tmp_path / "src" / header.name).read_bytes() == header.read_bytes()
    os.utime(copy, (1, 1))
    assert kernels._stable_copy(source, tmp_path) == copy and copy.stat().st_mtime == 1  # not rewritten: no rebuild


def test_the_build_directory_is_keyed_by_the_source_and_flags():
    source = kernels._HERE / "layer_ops.cpp"
    here = kernels._build_dir(source, ["-ffp-contract=off"])
    assert here == kernels._build_dir(source, ["-ffp-contract=off"])
    assert here != kernels._build_dir(source, [])
    assert here != kernels._build_dir(kernels._HERE / "rms_norm.cpp", ["-ffp-contract=off"])


def test_scripts_build_a_kernel_with_the_flags_eyas_builds_it_with(tmp_path, monkeypatch):
    """``build_flags`` is what scripts/kernel_ab.py compiles an earlier revision with: it must be what ``_build``
    passes to the compiler, -ffp-contract=off included where the kernel needs it."""
    import torch.utils.cpp_extension as ext

    calls = {}
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setattr(ext, "load", lambda name, sources, **kw: calls.setdefault(name, kw) and name)
    for name in ("gguf_bf16", "rms_norm"):
        assert kernels._build(name) == f"eyas_{name}"
        assert (calls[f"eyas_{name}"]["extra_cflags"], calls[f"eyas_{name}"]["extra_ldflags"]) == \
            kernels.build_flags(name)
    assert "-ffp-contract=off" in kernels.build_flags("gguf_bf16")[0]
    assert "-ffp-contract=off" not in kernels.build_flags("rms_norm")[0]


def test_one_time_notes_are_told_apart_from_other_stderr_lines(capsys):
    from eyas.notes import is_one_time_note, one_time_note

    one_time_note("compiling the decode-layer kernel for this CPU", "~30 s")
    one_time_note("sizing the draft tree to this machine: timing verify steps by width", "cached in /tmp/x.json")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "eyas: compiling the decode-layer kernel for this CPU (once, ~30 s)"
    assert all(is_one_time_note(ln) for ln in lines)
    assert not is_one_time_note("eyas: error: model path '/x' does not exist (expected a directory, a .gguf file)")
    assert not is_one_time_note("warning: something happened once, then again")


def test_prebuild_compiles_the_missing_kernels_at_once_in_child_processes(tmp_path, monkeypatch, capsys):
    """Each missing kernel this machine uses gets its own child process, as many at a time as there are cores; a
    kernel switched off, one already built and one already loaded get none; with one build left nothing runs in
    parallel, so prebuild leaves it to the first use."""
    import subprocess
    import threading

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setenv("EYAS_NORM_KERNEL", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    built = {"layer_ops"}
    monkeypatch.setattr(kernels, "_is_built", lambda name, out: name in built)
    monkeypatch.setattr(kernels, "_loaded", {"skinny_gemm": None})
    running, most, children = [0], [0], []
    lock = threading.Lock()

    def run(cmd, **kw):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            children.append(cmd[-1])
        threading.Event().wait(0.05)
        with lock:
            running[0] -= 1
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    kernels.prebuild(("rms_norm", "layer_ops", "skinny_gemm", "path_attn", "gguf_bf16", "gguf_f32"))
    assert sorted(c.split("_get(")[1] for c in children) == ["'gguf_bf16')", "'gguf_f32')", "'path_attn')"]
    assert most[0] == 2
    assert "compiling 3 CPU kernels for this CPU, 2 at a time (once, ~40 s)" in capsys.readouterr().err
    children.clear()
    kernels.prebuild(("path_attn", "layer_ops"))
    assert children == []
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # no compiler: each first use warns as before, no children
    kernels.prebuild(("path_attn", "gguf_bf16"))
    assert children == []
