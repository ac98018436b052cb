"""eyas's one-time notes on stderr: work done once per machine or environment and cached after (a kernel compiled,
the block kernel's options or the draft tree's step costs timed). Whether one appears depends on the cache, not on
the command, so anything that reads stderr (tests, scripts) can tell them apart with ``is_one_time_note``.
"""

from __future__ import annotations

import sys

_MARK = " (once, "


def one_time_note(what: str, cost: str) -> None:
    """Print ``eyas: {what} (once, {cost})`` on stderr, e.g. cost = "~30 s" or where the result is cached."""
    print(f"eyas: {what}{_MARK}{cost})", file=sys.stderr)


def is_one_time_note(line: str) -> bool:
    """Whether a stderr line is one of eyas's one-time notes."""
    return line.startswith("eyas: ") and _MARK in line and line.rstrip().endswith(")")
