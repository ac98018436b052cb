"""A GGUF file's tensors without its metadata: names, types, shapes and memory-mapped data.

``gguf.GGUFReader`` builds a numpy view of every metadata value, the tokenizer's ~100,000 strings included: 2.5 s
of the embedded default's load (Intel Xeon VM), where attaching the GGUF blocks needs only the tensor table. Here the
metadata is stepped over with ``struct`` (only ``general.alignment`` is read) and each tensor's data is the same
view of one ``np.memmap`` that ``GGUFReader`` gives (``tests/formats/test_gguf_index.py`` holds the two equal):
float and integer types as their numpy dtype, every block type as uint8 rows of bytes, dimensions reversed (ggml's
first dimension last).

    tensors = {t.name: t for t in read_tensors(path)}
    tensors["blk.0.attn_q.weight"].data        # np.ndarray [576, 336] uint8 for Q4_1 blocks
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# metadata value types (GGUFValueType) with a fixed size: struct format of one value
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class GGUFIndexError(ValueError):
    """The file is not a little-endian GGUF (version 2 or 3) this reader understands."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (first dimension fastest), ``data`` shaped as GGUFReader shapes it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        try:
            out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFIndexError("the file ends inside its header") from None
        self.pos += struct.calcsize("<" + fmt)
        return out

    def string(self) -> bytes:
        (n,) = self.take("Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise GGUFIndexError("the file ends inside its header")
        return bytes(self.buf[self.pos - n: self.pos])

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += struct.calcsize(_FIXED[vtype])
        elif vtype == _STRING:
            (n,) = self.take("Q")
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("IQ")
            if item in _FIXED:
                self.pos += count * struct.calcsize(_FIXED[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise GGUFIndexError(f"unknown metadata value type {vtype}")


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor of the GGUF file at ``path``, in file order. Raises GGUFIndexError for other files."""
    buf = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFIndexError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = cur.take("4xIQQ")
    if version not in (2, 3):
        raise GGUFIndexError(f"{path}: GGUF version {version} (this reader: 2 and 3, little-endian)")
    alignment = 32
    for _ in range(n_kv):
        key, (vtype,) = cur.string(), cur.take("I")
        if key == b"general.alignment" and vtype == 4:
            (alignment,) = cur.take("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8")
        (n_dims,) = cur.take("I")
        dims = cur.take(f"{n_dims}Q")
        raw_type, offset = cur.take("IQ")
        infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
    start = -(-cur.pos // alignment) * alignment
    return [_tensor(buf, start, *info) for info in infos]


def _tensor(buf: np.ndarray, start: int, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType,
            offset: int) -> GGUFTensor:
    n_elems = int(np.prod(dims, dtype=np.int64))
    shape = tuple(reversed(dims))
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_bytes = n_elems // block * type_size
    raw = buf[start + offset: start + offset + n_bytes]
    if raw.size != n_bytes:
        raise GGUFIndexError(f"tensor {name} runs past the end of the file")
    if qtype in _PLAIN:
        data = raw.view(_PLAIN[qtype]).reshape(shape)
    else:  # uint8 rows: the first dimension's elements as bytes
        data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
    return GGUFTensor(name=name, tensor_type=qtype, shape=dims, data=data)
