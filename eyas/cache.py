"""``eyas cache``: what eyas keeps under ``$EYAS_CACHE`` (default ``~/.cache/eyas``), and removing it.

eyas caches three kinds of things, all rebuilt on demand:
  conversions  a GGUF dequantised to a float32 HF directory (538 MB for the embedded default), named by the file's
               content; gguf_digests/ remembers each path's hash
  kernels      the C++ kernels compiled for this CPU and torch (kernels/)
  timings      per-machine choices timed at load: kernel options, the output screen, the head's int8 projections,
               tree costs, exact mode's row floors

`eyas cache info` lists them with sizes; `eyas cache purge --stale` removes what nothing needs any more:
conversions that are partial, path-keyed (older eyas) or of GGUF files now gone (and the hashes of such files),
and kernel builds that are partial,
for a torch install now gone, or not loaded for 30 days; `eyas cache purge [--only KIND]` removes everything (or one
kind).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("conversions", "kernels", "timings")
_TIMINGS = ("kernel_tuning", "lm_screen", "head_int8", "tree_costs", "row_floors.json")
_BUILDS, _STAMPS = "kernel builds", "GGUF hash stamps"  # Entry.group
KERNEL_UNUSED_DAYS = 30  # a kernel build not loaded for this long is stale (rebuilding one takes ~15 s)


@dataclass
class Entry:
    path: Path
    kind: str  # one of KINDS
    bytes: int
    stale: str = ""  # why purge --stale removes it; empty if something may still load it
    sources: list[str] = field(default_factory=list)  # conversions: the GGUF paths it was made from
    group: str = ""  # many small entries of one sort ("kernel builds"): counted by state, not listed one by one


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _unfinished(p: Path, now: float) -> str:
    """Why a partial entry is stale: only an hour after it was last written (it may still be in the making)."""
    return "partial (did not finish)" if now - p.stat().st_mtime > 3600 else ""


def _conversion(p: Path, now: float) -> Entry:
    if ".tmp" in p.name or not (p / "model.safetensors").exists():
        return Entry(p, "conversions", _size(p), stale=_unfinished(p, now))
    try:
        sources = json.loads((p / "source.json").read_text())["sources"]
    except (OSError, ValueError, KeyError):
        return Entry(p, "conversions", _size(p), stale="keyed by path (before content keys): re-made on demand")
    stale = "" if any(Path(s).exists() for s in sources) else "its GGUF files are gone"
    return Entry(p, "conversions", _size(p), stale=stale, sources=sources)


def _kernel_build(p: Path, now: float) -> Entry:
    """One kernel build directory (eyas.kernels: keyed by sources, flags, CPU and the torch install it links)."""
    return Entry(p, "kernels", _size(p), stale=_build_staleness(p, now), group=_BUILDS)


def _build_staleness(p: Path, now: float) -> str:
    """Why purge --stale removes a kernel build, or "" to keep it."""
    so = sorted(p.glob("*.so"))
    if not so:
        return _unfinished(p, now)
    try:
        cflags = next(ln for ln in (p / "build.ninja").read_text().splitlines() if ln.startswith("cflags"))
        torch_include = Path(cflags.split("-isystem ", 1)[1].split()[0])
    except (OSError, StopIteration, IndexError):
        return ""
    if not torch_include.exists():
        return "built for a torch install that is gone"
    stamp = p / "last_used"
    used = (stamp if stamp.exists() else so[0]).stat().st_mtime
    return f"not loaded for {KERNEL_UNUSED_DAYS} days" if now - used > KERNEL_UNUSED_DAYS * 86400 else ""


def _digest_stamps(d: Path) -> list[Entry]:
    """The GGUF hashes remembered by path (eyas.models.loading.gguf_digest), counted as one entry when current and
    one per stamp whose file is gone or changed (stale).
    """
    from eyas.models.loading import digest_stamp_current

    stamps = sorted(f for f in d.iterdir() if f.is_file())
    old = [f for f in stamps if not digest_stamp_current(f)]
    out = [Entry(f, "conversions", f.stat().st_size, stale="their GGUF file is gone or changed", group=_STAMPS)
           for f in old]
    if len(old) < len(stamps):
        out.append(Entry(d, "conversions", sum(f.stat().st_size for f in stamps if f not in old), group=_STAMPS))
    return out


def entries(root: Path) -> list[Entry]:
    """Everything under ``root``, classified; unknown files are left out (never removed)."""
    out: list[Entry] = []
    if not root.is_dir():
        return out
    now = time.time()
    for p in sorted(root.iterdir()):
        if p.name in _TIMINGS:
            out.append(Entry(p, "timings", _size(p)))
        elif p.name == "kernels" and p.is_dir():
            out.extend(_kernel_build(d, now) for d in sorted(p.iterdir()) if d.is_dir())
        elif p.name == "gguf_digests" and p.is_dir():
            out.extend(_digest_stamps(p))
        elif p.is_dir() and ((p / "config.json").exists() or ".tmp" in p.name):
            out.append(_conversion(p, now))
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def cmd_info(root: Path) -> int:
    found = entries(root)
    print(f"eyas cache: {root}")
    for kind in KINDS:
        mine = [e for e in found if e.kind == kind]
        print(f"{kind}: {len(mine)} entr{'y' if len(mine) == 1 else 'ies'}, {_mb(sum(e.bytes for e in mine))}")
        for group, why in sorted({(e.group, e.stale) for e in mine if e.group}):
            same = [e for e in mine if (e.group, e.stale) == (group, why)]
            print(f"  {len(same)} {group} {'stale: ' + why if why else 'kept'}, {_mb(sum(e.bytes for e in same))}")
        for e in (e for e in mine if not e.group):
            note = f"  [stale: {e.stale}]" if e.stale else ""
            src = f"  <- {', '.join(e.sources)}" if e.sources else ""
            print(f"  {e.path.name:<48} {_mb(e.bytes):>12}{src}{note}")
    stale = [e for e in found if e.stale]
    print(f"total {_mb(sum(e.bytes for e in found))}; `eyas cache purge --stale` would free "
          f"{_mb(sum(e.bytes for e in stale))}")
    return 0


def cmd_purge(root: Path, stale: bool, only: str | None) -> int:
    found = entries(root)
    chosen = [e for e in found if (not stale or e.stale) and (only is None or e.kind == only)]
    for e in chosen:
        if e.path.is_dir():
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            e.path.unlink(missing_ok=True)
        if not e.group:
            print(f"removed {e.path.name} ({e.kind}, {_mb(e.bytes)})")
    for group in sorted({e.group for e in chosen if e.group}):
        same = [e for e in chosen if e.group == group]
        print(f"removed {len(same)} {group} ({_mb(sum(e.bytes for e in same))})")
    print(f"freed {_mb(sum(e.bytes for e in chosen))} under {root}")
    return 0


def _run(a: argparse.Namespace) -> int:
    from eyas.models.loading import cache_root

    root = cache_root()
    if a.action == "purge":
        return cmd_purge(root, a.stale, a.only)
    return cmd_info(root)


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="list or remove what eyas caches (model conversions, kernels, timings)",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = c.add_subparsers(dest="action")
    csub.add_parser("info", help="list the cache's entries and sizes (the default)")
    p = csub.add_parser("purge", help="remove cached entries (all, one kind, or only stale ones)")
    p.add_argument("--stale", action="store_true",
                   help="only what nothing needs: partial or orphaned conversions and kernel builds (see above)")
    p.add_argument("--only", choices=KINDS, default=None, help="only this kind")
    c.set_defaults(func=_run, action="info", stale=False, only=None)
