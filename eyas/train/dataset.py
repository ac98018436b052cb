"""Tokenized self-distillation conversations for drafter training.

Reads jsonl in the OpenAI chat format (what ``eyas data`` writes: one
``{"messages": [{"role", "content"}...]}`` per line; ShareGPT
``conversations`` is accepted too), applies the target's chat template, and
marks the assistant tokens: ``loss_mask[t]`` is True when token t + 1 belongs
to an assistant turn (including its end-of-turn token), so position t is
trained to predict it.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.data.sources import chat_messages


@dataclass
class Example:
    # [T] long
    input_ids: torch.Tensor
    # [T] bool, token t + 1 is an assistant token
    loss_mask: torch.Tensor
    id: str = ""


def read_conversations(paths: list[str | Path], log=print) -> list[dict]:
    """jsonl files (plain, or packed as .xz / .gz, as data/selfdistill ships them) -> [{"id", "messages"}].

    A malformed record, or an unparsable line before the last, is a ValueError naming file and line.
    An unparsable last line (a write cut off by a kill while ``eyas data`` was writing the file) is
    skipped with a warning through ``log`` that names it.
    """
    out = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"training data {p} does not exist; create it with `eyas data --out {p}`")
        lines = _read_text(p).split("\n")  # not splitlines(): U+2028 etc. occur inside JSON strings
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if i < last:
                    raise ValueError(f"{p}:{i + 1}: not valid JSON ({e}); fix or remove that line") from None
                log(f"train: warning: skipped {p}:{i + 1}, an unparsable last line (a write cut off by a kill?)")
                continue
            if not isinstance(rec, dict):
                raise ValueError(f"{p}:{i + 1}: expected a JSON object per line, got {type(rec).__name__}")
            try:
                msgs = chat_messages(rec)
            except ValueError as e:
                raise ValueError(f"{p}:{i + 1}: {e}") from None
            if msgs and any(m.get("role") == "assistant" for m in msgs):
                out.append({"id": str(rec.get("id", f"{p.name}:{i}")), "messages": msgs})
    return out


def _read_text(p: Path) -> str:
    """A file's text, decompressed when it ends in .xz or .gz."""
    if p.suffix in (".xz", ".gz"):
        import gzip
        import lzma

        opener = lzma.open if p.suffix == ".xz" else gzip.open
        try:
            with opener(p, "rt", encoding="utf-8") as f:
                return f.read()
        except (lzma.LZMAError, OSError) as e:
            raise ValueError(f"{p}: not a readable {p.suffix[1:]} file ({e}); pass the JSONL, or a whole "
                             f"{p.suffix} file") from None
    return p.read_text(encoding="utf-8")


CHUNK = 1024  # conversations tokenized per batch call (their token lists are turned into tensors chunk by chunk)


def _turn_texts(tok, messages: list[dict]) -> list[str]:
    """For each assistant turn i: the chat-templated text before it (with the generation prompt), then the text
    through it; [before_1, upto_1, before_2, upto_2, ...].
    """
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            out.append(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            out.append(tok.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False))
    return out


def _example(turn_ids: list[list[int]], max_len: int) -> Example:
    """Token ids of ``_turn_texts`` (before_1, upto_1, ...) -> the conversation's ids and loss mask."""
    ids: list[int] = []
    is_asst: list[bool] = []
    for before, upto in zip(turn_ids[::2], turn_ids[1::2], strict=True):
        if upto[: len(before)] != before:
            raise ValueError("the chat template is not prefix-stable; cannot locate assistant tokens")
        if ids and before[: len(ids)] != ids:
            raise ValueError("the chat template renders earlier turns differently in later prompts")
        is_asst += [False] * (len(before) - len(ids)) + [True] * (len(upto) - len(before))
        ids = list(upto)
    ids, is_asst = ids[:max_len], is_asst[:max_len]
    t = torch.tensor(ids, dtype=torch.long)
    asst = torch.tensor(is_asst, dtype=torch.bool)
    loss = torch.zeros_like(asst)
    loss[:-1] = asst[1:]
    return Example(t, loss)


def tokenize_conversation(tok, messages: list[dict], max_len: int) -> Example:
    """Chat-template a conversation and mark assistant tokens (truncated to max_len tokens)."""
    texts = _turn_texts(tok, messages)
    return _example([tok(t, add_special_tokens=False)["input_ids"] for t in texts], max_len)


@contextmanager
def tokenizer_threads():
    """Let a fast tokenizer's batch calls use every core inside the block. ``eyas``'s CLI sets
    TOKENIZERS_PARALLELISM=false (no fork warnings from the server or the data workers), which the Rust side reads at
    each call, so the fifth GPU draw encoded its 47 k conversations on one of 16 cores (tokenizing took 75 s of its 90 s
    start). The old value comes back after, so a later fork still sees the variable set and stays quiet.
    """
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def load_examples(paths, tok, max_len: int = 1024, min_assistant: int = 4, log=print,
                  convs: list[dict] | None = None) -> list[Example]:
    """Tokenized conversations of ``paths`` (or the already read ``convs`` of those paths): ``tokenize_conversation``
    for each, with the texts of ``CHUNK`` conversations encoded in one batch call (a fast tokenizer spreads it over
    every core, ``tokenizer_threads``; on one core ~1.6 ms a conversation: 75 s of a GPU draw's 90 s start for 47 k).
    """
    convs = convs if convs is not None else read_conversations(paths, log)
    out = []
    for c0 in range(0, len(convs), CHUNK):
        chunk = convs[c0 : c0 + CHUNK]
        texts = [_turn_texts(tok, conv["messages"]) for conv in chunk]
        every = [t for ts in texts for t in ts]
        with tokenizer_threads():
            flat = tok(every, add_special_tokens=False)["input_ids"] if every else []
        at = 0
        for conv, ts in zip(chunk, texts, strict=True):
            ex = _example(flat[at : at + len(ts)], max_len)
            at += len(ts)
            ex.id = conv["id"]
            if int(ex.loss_mask.numpy().sum()) >= min_assistant:  # numpy: ~4 against torch's ~12 us a call
                out.append(ex)
    if not out:
        raise ValueError(f"no usable conversations in {', '.join(map(str, paths or []))}")
    return out


def split_holdout(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    """Deterministic held-aside split by id hash: (train, holdout of n)."""
    key = sorted(examples, key=lambda e: hashlib.sha1(e.id.encode()).hexdigest())
    hold = {id(e) for e in key[:n]}
    return [e for e in examples if id(e) not in hold], key[:n]


def collate(batch: list[Example], multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the longest, rounded up to a multiple of ``multiple``: input_ids, attention_mask, loss_mask
    [B, T]. A multiple > 1 gives the target's forward a few lengths instead of one per batch (on a GPU each new
    shape can cost the attention library a new plan); padded positions are masked out of attention and loss.
    """
    if multiple < 1:
        raise ValueError(f"the padding multiple must be >= 1, got {multiple}")
    t = max(e.input_ids.shape[0] for e in batch)
    t = -(-t // multiple) * multiple
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    att = torch.zeros(len(batch), t, dtype=torch.bool)
    loss = torch.zeros(len(batch), t, dtype=torch.bool)
    for i, e in enumerate(batch):
        n = e.input_ids.shape[0]
        ids[i, :n], att[i, :n], loss[i, :n] = e.input_ids, True, e.loss_mask
    return {"input_ids": ids, "attention_mask": att, "loss_mask": loss}


def token_batches(examples: list[Example], max_tokens: int, seed: int) -> list[list[int]]:
    """Shuffle (seeded), then group examples of similar length into batches of <= max_tokens padded tokens."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=g).tolist()
    chunks = [order[i : i + 256] for i in range(0, len(order), 256)]  # sort locally: less padding, still mixed
    batches = []
    for ch in chunks:
        ch.sort(key=lambda i: examples[i].input_ids.shape[0])
        cur: list[int] = []
        for i in ch:
            longest = max([examples[j].input_ids.shape[0] for j in cur] + [examples[i].input_ids.shape[0]])
            if cur and longest * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def draft_vocab(examples: list[Example], vocab_size: int, size: int,
                always: list[int] = ()) -> tuple[torch.Tensor, float]:
    """Most frequent assistant tokens -> ([size] sorted target ids, coverage of assistant tokens)."""
    counts = _assistant_counts(examples, vocab_size)
    score = counts.float()
    score[torch.as_tensor(list(always), dtype=torch.long)] = float("inf")
    ids = score.topk(min(size, vocab_size)).indices.sort().values
    coverage = float(counts[ids].sum() / counts.sum().clamp(min=1))
    return ids, coverage


def vocab_coverage(examples: list[Example], vocab_size: int, ids: torch.Tensor) -> float:
    """The share of assistant tokens of ``examples`` that the draft vocabulary ``ids`` ([Vd] target ids) holds."""
    counts = _assistant_counts(examples, vocab_size)
    return float(counts[ids.cpu()].sum() / counts.sum().clamp(min=1))


def _assistant_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[vocab_size] long: how often each token is an assistant token (a label) in ``examples``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.input_ids[1:][e.loss_mask[:-1]], minlength=vocab_size)
    return counts
