"""pdserve's GGUF reader (`engine.gguf._plain_view_reader`) gives the stock `gguf.GGUFReader`'s
fields part for part: the same names, offsets, types, data indices, and per part the same
dtype, shape and bytes. Its own loop over metadata arrays must not change what transformers
reads. Checked on files written here in both byte orders, covering every kind of array the
loop takes (strings, each scalar type; `gguf`'s writer refuses an empty array) and the
ones it leaves to the stock code (nested arrays); the real GGUFs are compared in test_real_model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.gguf import _plain_view_reader  # noqa: E402


def assert_same_fields(path: Path) -> None:
    stock, ours = gguf.GGUFReader(path), _plain_view_reader()(path)
    assert list(ours.fields) == list(stock.fields)
    for name, want in stock.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.name, got.data, got.types) == (
            want.offset,
            want.name,
            want.data,
            want.types,
        ), name
        assert len(got.parts) == len(want.parts), name
        for g, w in zip(got.parts, want.parts, strict=True):
            assert (g.dtype, g.shape, g.tobytes()) == (w.dtype, w.shape, w.tobytes()), name
    assert [(t.name, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.data.tobytes()) for t in stock.tensors
    ]


def _write(path: Path, endian: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_array("test.strings", ["", "a", "héllo wörld", "<|im_start|>", "x" * 300])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.ints", [1, -2, 3])
    for name, vtype in [
        ("u8", gguf.GGUFValueType.UINT8),
        ("i16", gguf.GGUFValueType.INT16),
        ("u32", gguf.GGUFValueType.UINT32),
        ("i64", gguf.GGUFValueType.INT64),
        ("f64", gguf.GGUFValueType.FLOAT64),
    ]:
        w.add_key_value(f"test.{name}", [1, 2, 7], gguf.GGUFValueType.ARRAY, sub_type=vtype)
    w.add_string("test.scalar_string", "after the arrays")
    w.add_uint32("test.scalar", 7)
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", ["little", "big"])
def test_the_reader_reads_the_stock_readers_fields(tmp_path: Path, endian: str) -> None:
    order = gguf.GGUFEndian.LITTLE if endian == "little" else gguf.GGUFEndian.BIG
    path = _write(tmp_path / f"{endian}.gguf", order)
    assert_same_fields(path)
    reader = _plain_view_reader()(path)
    assert reader.fields["test.strings"].contents() == [
        "",
        "a",
        "héllo wörld",
        "<|im_start|>",
        "x" * 300,
    ]
    assert reader.fields["test.i64"].contents() == [1, 2, 7]
    assert reader.fields["test.scalar_string"].contents() == "after the arrays"
