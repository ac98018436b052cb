"""Offline target features: computed once by the target, read back every epoch.

``FeatureCache(directory, featurizer)`` is a drop-in for the online feature
source of the training loop (``--feature-cache DIR``): called with the examples
of one batch it returns the ``FeatureBatch`` that ``featurizer(collate(...))``
would. Examples it has not seen are featurized together (one target forward on
a right-padded batch of just those) and appended to the cache, so the first
epoch fills it and later epochs never call the target.

Layout of ``DIR``::

    meta.json                  target identity; a cache built for another target is refused
    index.jsonl                one line per cached example: id, hash of its input_ids, shard, offset, length
    shard_00000.safetensors    rows of several examples, concatenated on the token axis:
                                 hidden [N, D], taps [N, L, D] (target dtype), target_tokens [N] int32

Crash safety (SIGKILL at any point): a shard is written under a temporary name,
fsynced, and linked to its final name before any index line refers to it; the
index lines of one shard go out in a single append. A restart therefore sees
either the whole shard in the index or none of it: leftover ``*.tmp`` files and
shards no index line names are ignored (delete them to reclaim space), and an
unparsable (torn) index line is skipped. Several processes (DDP ranks) may fill
one directory at once: shard names are claimed with a no-clobber ``os.link``,
appends are single ``O_APPEND`` writes, and a miss first re-reads what the
other ranks appended.

Reads go through ``safetensors.safe_open(...).get_slice`` on a small LRU of open
shards, so memory stays at one batch of features whatever the cache size.
Padding positions (``attention_mask`` False) hold zeros, where the online path
holds the target's features of the pad token; no objective reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.train.dataset import Example, collate
from eyas.train.features import FeatureBatch, TargetFeaturizer

FORMAT = 1
_SHARD_RE = re.compile(r"^shard_(\d+)\.safetensors$")


@dataclass(frozen=True)
class _Entry:
    """Where one example's rows live: ``shard`` rows ``offset .. offset + length``."""

    id: str
    hash: str
    shard: str
    offset: int
    length: int


@dataclass
class _Rows:
    """One example's features, T = its true length."""

    # [T, D]
    hidden: torch.Tensor
    # [T, L, D]
    taps: torch.Tensor
    # [T] long
    target_tokens: torch.Tensor


def ids_hash(input_ids: torch.Tensor) -> str:
    """[T] token ids -> hex digest; a re-tokenized or edited example gets a new one."""
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().cpu().numpy().tobytes()).hexdigest()[:32]


def target_identity(featurizer: TargetFeaturizer) -> dict:
    """What the cached features depend on, beyond the token ids (stored in meta.json)."""
    t = featurizer.target
    c = t.config
    ident = {
        "format": FORMAT,
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "tap_layers": list(featurizer.tap_layers),
        "dtype": str(t.dtype).removeprefix("torch."),
    }
    if hasattr(t, "named_parameters"):
        ident["weights"] = _weights_fingerprint(t)
    return ident


def _weights_fingerprint(module: torch.nn.Module, per_param: int = 64) -> str:
    """Hash of a strided sample of every parameter.

    Tells two checkpoints of one architecture apart (e.g. a base and an instruct model); it
    hashes exact values, so a target loaded on CPU and on GPU agrees.
    """
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // per_param)][:per_param]
        h.update(name.encode())
        h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


class FeatureCache:
    """list[Example] -> FeatureBatch, featurizing (and storing) only what is not cached yet."""

    def __init__(self, directory: str | Path, featurizer: TargetFeaturizer, max_open: int = 8) -> None:
        self.dir = Path(directory)
        self.featurizer = featurizer
        self.max_open = max_open
        self.dir.mkdir(parents=True, exist_ok=True)
        self._check_meta(target_identity(featurizer))
        self._index: dict[tuple[str, str], _Entry] = {}  # (id, hash) -> newest entry
        self._index_pos = 0  # bytes of index.jsonl already read
        self._open: OrderedDict[str, object] = OrderedDict()  # shard name -> safe_open handle (LRU)
        self.computed = 0  # examples featurized by the target through this object
        self.read = 0  # examples served from disk
        self._refresh()

    def __len__(self) -> int:
        return len(self._index)

    def __call__(self, examples: list[Example]) -> FeatureBatch:
        keys = [_key(e) for e in examples]
        missing = {k: e for k, e in zip(keys, examples, strict=True) if k not in self._index}
        if missing:
            self._refresh()  # another rank may have featurized them meanwhile
            missing = {k: e for k, e in missing.items() if k not in self._index}
        fresh = self._compute(missing) if missing else {}
        rows = [fresh[k] if k in fresh else self._load(self._index[k]) for k in keys]
        self.read += len(keys) - sum(k in fresh for k in keys)
        return self._assemble(examples, rows)

    # --- building ---------------------------------------------------------------------------

    def _compute(self, todo: dict[tuple[str, str], Example]) -> dict[tuple[str, str], _Rows]:
        """Featurize ``todo`` in one target forward, store it as one shard, return per-example rows."""
        exs = list(todo.values())
        b = collate(exs)
        fb = self.featurizer(b["input_ids"], b["attention_mask"], b["loss_mask"])
        dtype = self.featurizer.target.dtype
        if fb.hidden.dtype != dtype:
            raise ValueError(f"featurizer returned {fb.hidden.dtype} features for a {dtype} target")
        out = {}
        for i, (k, e) in enumerate(todo.items()):
            n = e.input_ids.shape[0]
            out[k] = _Rows(fb.hidden[i, :n].cpu(), fb.taps[i, :n].cpu(), fb.target_tokens[i, :n].cpu())
        self.computed += len(exs)
        self._store(out)
        return out

    def _store(self, rows: dict[tuple[str, str], _Rows]) -> None:
        tensors = {
            "hidden": torch.cat([r.hidden for r in rows.values()]).contiguous(),
            "taps": torch.cat([r.taps for r in rows.values()]).contiguous(),
            "target_tokens": torch.cat([r.target_tokens for r in rows.values()]).to(torch.int32).contiguous(),
        }
        tmp = self.dir / f"shard-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": str(FORMAT)})
        _fsync(tmp)
        name = self._claim_shard_name(tmp)
        entries, offset = [], 0
        for (eid, h), r in rows.items():
            n = r.hidden.shape[0]
            entries.append(_Entry(eid, h, name, offset, n))
            offset += n
        self._append_index(entries)

    def _claim_shard_name(self, tmp: Path) -> str:
        """Give ``tmp`` the next free shard_NNNNN name; no-clobber, so concurrent writers never collide."""
        while True:
            nums = [int(m.group(1)) for p in os.listdir(self.dir) if (m := _SHARD_RE.match(p))]
            name = f"shard_{max(nums, default=-1) + 1:05d}.safetensors"
            try:
                os.link(tmp, self.dir / name)  # fails if the name exists, unlike rename
            except FileExistsError:
                continue
            tmp.unlink()
            _fsync_dir(self.dir)
            return name

    def _append_index(self, entries: list[_Entry]) -> None:
        path = self.dir / "index.jsonl"
        block = "".join(json.dumps(asdict(e)) + "\n" for e in entries)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                block = "\n" + block  # end a line torn by a crash, so this block parses
            os.write(fd, block.encode())  # one append: a SIGKILL cannot leave half of it
            os.fsync(fd)
        finally:
            os.close(fd)
        for e in entries:
            self._index[(e.id, e.hash)] = e

    # --- reading ----------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Read index lines appended since the last call (by this or any other process)."""
        path = self.dir / "index.jsonl"
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(self._index_pos)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written (no newline yet) is read next time
        self._index_pos += end
        shards: dict[str, bool] = {}
        for line in data[:end].splitlines():
            try:
                e = _Entry(**json.loads(line))
            except (ValueError, TypeError):
                continue  # blank, or torn by a crash
            if shards.setdefault(e.shard, (self.dir / e.shard).exists()):
                self._index[(e.id, e.hash)] = e

    def _load(self, e: _Entry) -> _Rows:
        f = self._shard(e.shard)
        s = slice(e.offset, e.offset + e.length)
        return _Rows(f.get_slice("hidden")[s], f.get_slice("taps")[s], f.get_slice("target_tokens")[s].long())

    def _shard(self, name: str):
        f = self._open.pop(name, None)
        if f is None:
            f = safe_open(str(self.dir / name), framework="pt", device="cpu")
            while len(self._open) >= self.max_open:
                self._open.popitem(last=False)  # least recently used; its file closes when collected
        self._open[name] = f
        return f

    def _assemble(self, examples: list[Example], rows: list[_Rows]) -> FeatureBatch:
        """Right-pad per-example rows into a batch like ``collate``; padding rows are zero."""
        b = collate(examples)
        n_b, n_t = b["input_ids"].shape
        d, n_l = rows[0].hidden.shape[-1], rows[0].taps.shape[1]
        hidden = rows[0].hidden.new_zeros(n_b, n_t, d)
        taps = rows[0].taps.new_zeros(n_b, n_t, n_l, d)
        tokens = torch.zeros(n_b, n_t, dtype=torch.long)
        for i, r in enumerate(rows):
            n = r.hidden.shape[0]
            hidden[i, :n], taps[i, :n], tokens[i, :n] = r.hidden, r.taps, r.target_tokens
        dev = self.featurizer.target.device
        return FeatureBatch(
            input_ids=b["input_ids"].to(dev),
            attention_mask=b["attention_mask"].to(dev),
            loss_mask=b["loss_mask"].to(dev),
            hidden=hidden.to(dev),
            taps=taps.to(dev),
            target_tokens=tokens.to(dev),
        )

    # --- identity ---------------------------------------------------------------------------

    def _check_meta(self, ident: dict) -> None:
        path = self.dir / "meta.json"
        if not path.exists():
            tmp = self.dir / f"meta-{os.getpid()}-{uuid.uuid4().hex[:8]}.json.tmp"
            tmp.write_text(json.dumps(ident, indent=1) + "\n")
            _fsync(tmp)
            try:
                os.link(tmp, path)  # another rank may have written it first: then compare with theirs
            except FileExistsError:
                pass
            tmp.unlink()
        have = json.loads(path.read_text())
        diff = [
            f"{k} {ident.get(k)!r} (cache: {have.get(k)!r})"
            for k in sorted(set(ident) | set(have))
            if ident.get(k) != have.get(k)
        ]
        if diff:
            raise ValueError(
                f"feature cache {self.dir} was built for a different target or taps: {'; '.join(diff)}. "
                f"Use another --feature-cache directory, or delete {self.dir} to rebuild it."
            )


def _key(e: Example) -> tuple[str, str]:
    return (e.id, ids_hash(e.input_ids))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename/link durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        _fsync(path)
    except OSError:
        pass
