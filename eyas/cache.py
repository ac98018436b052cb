"""``eyas cache``: what eyas keeps under ``$EYAS_CACHE`` (default ``~/.cache/eyas``), and removing it.

eyas caches three kinds of things, all rebuilt on demand:
  conversions  a GGUF dequantised to a float32 HF directory (538 MB for the embedded default), named by the file's
               content; gguf_digests/ remembers each path's hash
  kernels      the C++ kernels compiled for this CPU and torch (kernels/)
  timings      per-machine choices timed at load: kernel options, the output screen, the head's int8 projections,
               tree costs, exact mode's row floors

`eyas cache info` lists them with sizes; `eyas cache purge --stale` removes conversions nothing needs any more
(partial ones, the older path-keyed ones, those whose GGUF files are all gone); `eyas cache purge [--only KIND]`
removes everything (or one kind).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("conversions", "kernels", "timings")
_TIMINGS = ("kernel_tuning", "lm_screen", "head_int8", "tree_costs", "row_floors.json")


@dataclass
class Entry:
    path: Path
    kind: str  # one of KINDS
    bytes: int
    stale: str = ""  # why purge --stale removes it; empty if something may still load it
    sources: list[str] = field(default_factory=list)  # conversions: the GGUF paths it was made from


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _conversion(p: Path) -> Entry:
    if ".tmp" in p.name or not (p / "model.safetensors").exists():
        return Entry(p, "conversions", _size(p), stale="partial (a conversion that did not finish)")
    try:
        sources = json.loads((p / "source.json").read_text())["sources"]
    except (OSError, ValueError, KeyError):
        return Entry(p, "conversions", _size(p), stale="keyed by path (before content keys): re-made on demand")
    stale = "" if any(Path(s).exists() for s in sources) else "its GGUF files are gone"
    return Entry(p, "conversions", _size(p), stale=stale, sources=sources)


def entries(root: Path) -> list[Entry]:
    """Everything under ``root``, classified; unknown files are left out (never removed)."""
    out: list[Entry] = []
    if not root.is_dir():
        return out
    for p in sorted(root.iterdir()):
        if p.name in _TIMINGS:
            out.append(Entry(p, "timings", _size(p)))
        elif p.name in ("kernels", "gguf_digests"):
            out.append(Entry(p, "kernels" if p.name == "kernels" else "conversions", _size(p)))
        elif p.is_dir() and ((p / "config.json").exists() or ".tmp" in p.name):
            out.append(_conversion(p))
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def cmd_info(root: Path) -> int:
    found = entries(root)
    print(f"eyas cache: {root}")
    for kind in KINDS:
        mine = [e for e in found if e.kind == kind]
        print(f"{kind}: {len(mine)} entr{'y' if len(mine) == 1 else 'ies'}, {_mb(sum(e.bytes for e in mine))}")
        for e in mine:
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
        print(f"removed {e.path.name} ({e.kind}, {_mb(e.bytes)})")
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
                   help="only conversions nothing needs: partial, path-keyed (older eyas), or of GGUF files now gone")
    p.add_argument("--only", choices=KINDS, default=None, help="only this kind")
    c.set_defaults(func=_run, action="info", stale=False, only=None)
