"""The generated data file: one conversation per jsonl line, resumable after a kill.

Line format (OpenAI chat format plus provenance)::

    {"id": "alpaca:123", "source": "alpaca",
     "messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}],
     "generator": {"backend": ..., "model": ..., "temperature": ..., ...},
     "usage": {"prompt_tokens": 57, "completion_tokens": 211},
     "finish_reasons": ["stop"]}

``usage`` sums over the conversation's turns; ``finish_reasons`` has one entry per
assistant turn, ``"stop"`` (a stop token) or ``"length"`` (max_new_tokens or the
context ran out). Each line is written with one ``write`` and flushed, so a run
killed at any moment (even SIGKILL) leaves whole lines plus at most one cut-off
last line; ``OutputFile.resume`` cuts that line away and returns the ids already
done, which the next run skips.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eyas.data.sources import Conversation


@dataclass
class TurnAnswer:
    """One regenerated assistant turn."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length"


def make_record(conv: Conversation, answers: list[TurnAnswer], generator: dict) -> dict:
    """The output line of a finished conversation: its turns interleaved with the answers."""
    if len(answers) != len(conv.turns):
        raise ValueError(f"{conv.id}: {len(answers)} answers for {len(conv.turns)} turns")
    return {
        "id": conv.id,
        "source": conv.source,
        "messages": _interleave(conv.turns, answers),
        "generator": generator,
        "usage": {
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "completion_tokens": sum(a.completion_tokens for a in answers),
        },
        "finish_reasons": [a.finish_reason for a in answers],
    }


def history_messages(conv: Conversation, answers: list[TurnAnswer]) -> list[dict]:
    """The prompt of turn ``len(answers)``: earlier turns with the target's own answers, then this turn."""
    return _interleave(conv.turns, answers) + conv.turns[len(answers)]


def _interleave(turns: list[list[dict]], answers: list[TurnAnswer]) -> list[dict]:
    """The first len(answers) turns, each followed by its assistant answer."""
    messages: list[dict] = []
    for turn, answer in zip(turns, answers, strict=False):  # answers may cover only a prefix
        messages += turn
        messages.append({"role": "assistant", "content": answer.text})
    return messages


class OutputFile:
    """Append-only jsonl output that knows which conversation ids it already holds."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._f = None

    def resume(self) -> set[str]:
        """Repair a cut-off last line and return the ids already written (the file is not created)."""
        if self.path.is_dir():
            raise ValueError(f"--out {self.path} is a directory; pass a .jsonl file path")
        return self._scan() if self.path.exists() else set()

    def _scan(self) -> set[str]:
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        if tail.strip() and not _parses(tail):
            # a line cut off by a kill: drop it, the conversation is generated again
            with open(self.path, "r+b") as f:
                f.truncate(cut)
            data = data[:cut]
        elif tail.strip():  # a complete last line that only lacks its newline
            with open(self.path, "ab") as f:
                f.write(b"\n")
        done = set()
        for n, line in enumerate(data.decode("utf-8").split("\n"), 1):
            if not line.strip():
                continue
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"{self.path}:{n} is not a line written by `eyas data` (no JSON object with an id); "
                    f"fix or remove it, or pass another --out"
                ) from None
        return done

    def write(self, record: dict) -> None:
        """Append one line; flushed to the OS at once so a killed process loses nothing written."""
        if self._f is None:  # opened at the first line, so a run that fails early leaves no empty file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


class Sink:
    """Where generators report: finished conversations are written, tokens counted.

    Generators call ``tokens(n)`` as batches finish (progress bars show tokens/s) and
    ``done(conv, answers)`` once per conversation; ``skip`` for conversations that
    cannot be generated (too long for the context, refused by the endpoint).
    """

    def __init__(self, out: OutputFile, generator: dict, progress=None) -> None:
        self.out, self.generator, self.progress = out, generator, progress
        self.conversations = 0
        self.generated_tokens = 0
        self.skipped: list[tuple[str, str]] = []  # (id, why)

    def tokens(self, n: int) -> None:
        self.generated_tokens += n
        if self.progress is not None:
            self.progress.tokens(self.generated_tokens)

    def done(self, conv: Conversation, answers: list[TurnAnswer]) -> None:
        self.out.write(make_record(conv, answers, self.generator))
        self.conversations += 1
        if self.progress is not None:
            self.progress.advance()

    def skip(self, conv: Conversation, why: str) -> None:
        self.skipped.append((conv.id, why))
        if self.progress is not None:
            self.progress.advance(skipped=True)
