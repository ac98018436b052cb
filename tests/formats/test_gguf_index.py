"""eyas.formats.gguf_index reads a GGUF file's tensors as gguf.GGUFReader does, without its metadata."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from eyas.formats.gguf_index import GGUFIndexError, read_tensors


def assert_same_tensors(path) -> list:
    ours, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    return ours


def write_gguf(path, alignment: int | None = None) -> None:
    """Every metadata value type (string arrays and an array of arrays included) and float, int and block tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**40)
    w.add_string("t.s", "héllo")
    w.add_array("t.strings", ["a", "bc", "", "déf"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.nested", [[1, 2], [3]])
    g = np.random.default_rng(0)
    w.add_tensor("f32", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", g.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    blocks = g.integers(0, 256, (6, 2 * 34), dtype=np.uint8)  # 6 rows of 64 values as Q8_0 bytes
    w.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_file_reads_as_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write_gguf(path, alignment)
    tensors = {t.name: t for t in assert_same_tensors(path)}
    assert tensors["q8"].data.shape == (6, 68) and tensors["q8"].shape == (64, 6)
    assert tensors["f16"].data.dtype == np.float16 and tensors["f16"].data.shape == (4, 7)


def test_embedded_default_reads_as_gguf_reader_reads_it(embedded_bf16):
    tensors = assert_same_tensors(embedded_bf16[1])
    assert {t.tensor_type.name for t in tensors} >= {"Q8_0", "F32"}


def test_other_files_are_refused_by_name(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path)
    raw = path.read_bytes()
    (tmp_path / "not.gguf").write_bytes(b"GGML" + raw[4:])
    with pytest.raises(GGUFIndexError, match="not a GGUF file"):
        read_tensors(tmp_path / "not.gguf")
    (tmp_path / "v1.gguf").write_bytes(raw[:4] + (1).to_bytes(4, "little") + raw[8:])
    with pytest.raises(GGUFIndexError, match="version 1"):
        read_tensors(tmp_path / "v1.gguf")
    (tmp_path / "cut.gguf").write_bytes(raw[:200])
    with pytest.raises(GGUFIndexError, match="ends inside its header"):
        read_tensors(tmp_path / "cut.gguf")
    (tmp_path / "short.gguf").write_bytes(raw[:-100])  # into the last tensor, past its padding
    with pytest.raises(GGUFIndexError, match="runs past the end"):
        read_tensors(tmp_path / "short.gguf")


def test_a_file_the_index_refuses_is_read_by_gguf_py(tmp_path, monkeypatch):
    """attach_gguf_blocks reads the tensor table through the index, and through gguf-py where the index refuses."""
    from eyas.formats import gguf_index
    from eyas.models.gguf_blocks import file_tensors

    path = tmp_path / "t.gguf"
    write_gguf(path)
    assert type(file_tensors(path)["q8"]).__name__ == "GGUFTensor"

    def refuse(p):
        raise GGUFIndexError("not understood")

    monkeypatch.setattr(gguf_index, "read_tensors", refuse)
    tensors = file_tensors(path)
    assert type(tensors["q8"]).__name__ == "ReaderTensor"
    assert list(tensors) == ["f32", "f16", "i32", "q8"]
    assert np.array_equal(tensors["q8"].data, read_tensors(path)[3].data)
