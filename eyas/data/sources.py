"""Prompt sets -> conversations whose assistant answers the target regenerates.

Named sources live under the data directory (``../shared/data/train`` by default,
see its README.md): ``alpaca``, ``gsm8k``, ``code_alpaca`` and ``mt_bench_101``;
``all`` means all four. Any other spec is a path to a ``.jsonl`` / ``.json`` file
of conversations in one of the common chat formats:

- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``
- OpenAI:   ``{"messages": [{"role": "user" | "assistant" | "system", "content": ...}]}``
- EAGLE / FastChat question files: ``{"turns": ["user turn 1", "user turn 2"]}``

(records in the train sources' own formats, ``instruction``/``input``, ``question`` or
``history``, are recognised in any file too). The Alpaca 52K file always drops its
evaluation prompts, see ``ALPACA_EXCLUDED``.

Existing assistant answers are dropped (they are what gets regenerated); system
messages are kept in place. Every conversation gets a stable id
``"<source>:<0-based record index>"``, e.g. ``"alpaca:123"``, so a resumed run
skips exactly what an earlier run wrote.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# The four training prompt sets of shared/data/train and their files.
TRAIN_SOURCES = {
    "alpaca": "alpaca/alpaca_data_52k.json",
    "gsm8k": "gsm8k/train.jsonl",
    "code_alpaca": "code_alpaca/code_alpaca_2k.json",
    "mt_bench_101": "mt_bench_101/mtbench101.jsonl",
}

# 0-based Alpaca 52K records that ARE evaluation prompts: all 80 prompts of the Alpaca eval
# set (alpaca/question.jsonl), as listed in shared/data/README.md, section "Overlap between
# evaluation and training files". Training on them would leak the eval set.
ALPACA_EVAL_OVERLAP = (
    597, 1089, 1494, 1547, 2728, 3560, 4264, 4847, 5163, 5652, 5730, 6746, 6958,
    7682, 8350, 9212, 9382, 10280, 10535, 10877, 10899, 11664, 11774, 11960,
    12408, 13270, 13539, 13999, 14092, 14509, 15106, 16139, 17970, 18073, 18161,
    18182, 18477, 20820, 22960, 23395, 24653, 25542, 25613, 25787, 25809, 26044,
    27251, 27579, 27883, 28708, 28988, 29350, 29913, 31281, 31688, 33247, 35119,
    35262, 35548, 35992, 36161, 36939, 37509, 37527, 39119, 39648, 39979, 40029,
    42504, 42729, 42889, 44237, 44987, 46443, 46507, 47196, 48486, 49422, 51369,
    51794,
)
# Same README section: Alpaca record 3964 ("Prove the Pythagorean Theorem.") is the second
# turn of MT-bench question 99, another evaluation prompt; dropped for the same reason.
ALPACA_MT_BENCH_OVERLAP = (3964,)
ALPACA_EXCLUDED = frozenset(ALPACA_EVAL_OVERLAP + ALPACA_MT_BENCH_OVERLAP)

# ShareGPT "from" values -> OpenAI roles. Assistant turns are dropped, so only their names matter.
_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
_OPENAI_ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    """One conversation to regenerate: the target answers after each turn in order."""

    id: str  # "<source>:<record index>", unique over a run
    source: str
    # turns[k]: the non-assistant messages ({"role", "content"}) sent before answer k;
    # every turn holds at least one user message, system messages stay where they were
    turns: list[list[dict]]


@dataclass
class Source:
    name: str  # the id prefix: a train source name or the file's stem
    path: Path
    # 0-based record indices never read (evaluation prompts)
    excluded: frozenset[int] = frozenset()


def read_sources(specs: Iterable[str], data_dir: str | Path | None, limit: int | None = None,
                 shuffle_seed: int | None = None) -> list[Conversation]:
    """Read every source of ``specs`` (names, paths, ``all``; comma-separated or repeated).

    Each source is shuffled with ``shuffle_seed`` (when given), then cut to ``limit``
    conversations; sources keep the order they were named in.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    out: list[Conversation] = []
    seen: dict[str, Path] = {}
    for src in resolve_specs(specs, data_dir):
        if src.name in seen:
            raise ValueError(f"two prompt sources are both named {src.name!r} ({seen[src.name]} and "
                             f"{src.path}); rename one file, conversation ids must be unique")
        seen[src.name] = src.path
        convs = read_source(src)
        if shuffle_seed is not None:
            random.Random(f"{shuffle_seed}:{src.name}").shuffle(convs)
        out += convs[:limit] if limit is not None else convs
    return out


def resolve_specs(specs: Iterable[str], data_dir: str | Path | None) -> list[Source]:
    """Spec strings -> sources: ``all``, a train source name, or a file path."""
    items = [s.strip() for spec in specs for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError("--prompts is empty; pass 'all', a source name or a .jsonl path")
    out = []
    for item in items:
        if item == "all" or item in TRAIN_SOURCES:
            root = _data_dir(data_dir, item)
            names = list(TRAIN_SOURCES) if item == "all" else [item]
            out += [_source(n, _existing_file(root / TRAIN_SOURCES[n], n)) for n in names]
        else:
            path = _existing_file(Path(item).expanduser())
            out.append(_source(path.stem, path))
    return out


def _source(name: str, path: Path) -> Source:
    # the Alpaca 52K file drops its evaluation prompts however it was named on the command line
    alpaca = path.name == Path(TRAIN_SOURCES["alpaca"]).name
    return Source(name, path, ALPACA_EXCLUDED if alpaca else frozenset())


def _data_dir(data_dir: str | Path | None, item: str) -> Path:
    if data_dir is None:
        raise ValueError(f"--prompts {item} needs the training data directory; pass --data-dir DIR")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"data directory {root} does not exist (needed for --prompts {item}); pass "
            f"--data-dir DIR (the folder holding alpaca/, gsm8k/, code_alpaca/, mt_bench_101/) "
            f"or set EYAS_DATA_DIR"
        )
    return root


def _existing_file(path: Path, name: str | None = None) -> Path:
    if path.is_file():
        return path
    if name is not None:
        raise FileNotFoundError(f"prompt source {name!r}: {path} is missing; check --data-dir")
    known = ", ".join(["all", *TRAIN_SOURCES])
    raise FileNotFoundError(f"--prompts {path}: no such file and not a source name (known: {known})")


def read_source(src: Source) -> list[Conversation]:
    """All conversations of one source file, in file order (excluded records skipped)."""
    convs = []
    for index, record in enumerate(_load_records(src.path)):
        if index in src.excluded:
            continue
        try:
            turns = record_turns(record)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{src.path}: record {index} is not a {_FORMAT_HELP} ({e})") from None
        if turns:
            convs.append(Conversation(id=f"{src.name}:{index}", source=src.name, turns=turns))
    return convs


def _load_records(path: Path) -> list:
    """A .json array, or one JSON value per non-empty line (.jsonl)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of records or a .jsonl file")
        return data
    records = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit in a string
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON ({e})") from None
    return records


def record_turns(record: dict) -> list[list[dict]]:
    """One record in any supported format -> its turns (see ``Conversation.turns``)."""
    if not isinstance(record, dict):
        raise TypeError(f"expected an object, got {type(record).__name__}")
    for key, reader in _READERS.items():
        if key in record:
            return reader(record)
    raise KeyError(f"none of the keys {', '.join(_READERS)}")


# ---- per-format readers: record -> turns ---------------------------------------------------------
def _user(text: str) -> list[dict]:
    if not isinstance(text, str):
        raise TypeError(f"expected a string prompt, got {type(text).__name__}")
    return [{"role": "user", "content": text}]


def _instruction(record: dict) -> list[list[dict]]:
    """Alpaca-style: the instruction, then a blank line and the input when the input is not empty."""
    text = record["instruction"]
    extra = record.get("input") or ""
    return [_user(f"{text}\n\n{extra}" if extra.strip() else text)]


def _question(record: dict) -> list[list[dict]]:
    return [_user(record["question"])]


def _history(record: dict) -> list[list[dict]]:
    """MT-Bench-101: the user side of ``history``; the ``bot`` side is regenerated."""
    return [_user(h["user"]) for h in record["history"]]


def _sharegpt(record: dict) -> list[list[dict]]:
    return split_turns([_sharegpt_message(m) for m in record["conversations"]])


def _openai(record: dict) -> list[list[dict]]:
    return split_turns([_openai_message(m) for m in record["messages"]])


def _turns(record: dict) -> list[list[dict]]:
    """EAGLE / FastChat question files: ``turns`` is the list of user turns."""
    return [_user(t) for t in record["turns"]]


def chat_messages(record: dict) -> list[dict] | None:
    """A chat record's messages, assistant turns included, in the OpenAI shape (None: not a chat record).

    Raises ValueError naming what is wrong when the record's message list is malformed.
    """
    for key, read in (("messages", _openai_message), ("conversations", _sharegpt_message)):
        if key not in record:
            continue
        msgs = record[key]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"{key!r} must be a list of message objects, got {json.dumps(msgs)[:60]}")
        try:
            out = [read(m) for m in msgs]
        except KeyError as e:
            raise ValueError(f"a message in {key!r} has no {e} field") from None
        bad = next((m for m in out if not isinstance(m["content"], str)), None)
        if bad is not None:
            raise ValueError(f"message content must be a string, got {type(bad['content']).__name__}")
        return out
    return None


def _sharegpt_message(m: dict) -> dict:
    role = _SHAREGPT_ROLES.get(str(m["from"]).lower())
    if role is None:
        raise ValueError(f"unknown ShareGPT speaker {m['from']!r}; known: {', '.join(_SHAREGPT_ROLES)}")
    return {"role": role, "content": m["value"]}


def _openai_message(m: dict) -> dict:
    if m["role"] not in _OPENAI_ROLES:
        raise ValueError(f"unsupported role {m['role']!r}; expected one of {', '.join(_OPENAI_ROLES)}")
    return {"role": m["role"], "content": m["content"]}


def split_turns(messages: list[dict]) -> list[list[dict]]:
    """Drop assistant messages; group the rest into turns, each ending at a user message.

    Example: [system, user A, assistant, user B, assistant] -> [[system, user A], [user B]].
    Consecutive user messages stay in one turn (one answer follows them); messages after
    the last user message (a trailing system note) have nothing to answer and are dropped.
    """
    turns: list[list[dict]] = []
    pending: list[dict] = []
    for m in messages:
        if not isinstance(m["content"], str):
            raise TypeError(f"message content must be a string, got {type(m['content']).__name__}")
        if m["role"] == "assistant":
            if any(p["role"] == "user" for p in pending):
                turns.append(pending)
                pending = []
            continue
        pending.append(m)
    if any(p["role"] == "user" for p in pending):
        turns.append(pending)
    return turns


# The key that identifies each record format, tried in this order.
_READERS: dict[str, Callable[[dict], list[list[dict]]]] = {
    "conversations": _sharegpt,
    "messages": _openai,
    "turns": _turns,
    "history": _history,
    "instruction": _instruction,
    "question": _question,
}
_FORMAT_HELP = ("supported prompt record (ShareGPT 'conversations', OpenAI 'messages', 'turns', "
                "MT-Bench-101 'history', Alpaca 'instruction'/'input', GSM8K 'question')")
