"""Tests for glmserve.models.gguf_reader on small files written by gguf-py's GGUFWriter: every metadata value
type equals gguf-py's GGUFReader parse, and damaged files raise GGUFFormatError. (The embedded file against
gguf-py: tests/test_gguf_loader.py.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from glmserve.models.gguf_reader import GGUFFormatError, read_header
from tests.test_gguf_loader import assert_header_equals_gguf_py


def write_all_types(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 世界 🙂")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strings", ["a", "", "日本語", "x y"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("q8", blocks, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_equals_gguf_py(tmp_path):
    path = write_all_types(tmp_path / "types.gguf")
    header = read_header(path)
    assert_header_equals_gguf_py(header, gguf.GGUFReader(path))
    assert header.metadata["t.strings"] == ["a", "", "日本語", "x y"]
    assert header.metadata["t.ints"].dtype == np.int32 and header.metadata["t.bool"] is True
    assert header.tensors[2].data.shape == (4, 68)  # Q8_0 rows as bytes: 2 blocks of 34


def test_truncated_anywhere_raises(tmp_path):
    data = write_all_types(tmp_path / "types.gguf").read_bytes()
    last_byte = len(data) - 32  # the writer pads the last tensor to the alignment (32): cuts there lose nothing
    ends = sorted({*range(0, 64, 7), *range(64, last_byte, max(1, last_byte // 40))})
    for end in ends:
        (tmp_path / "cut.gguf").write_bytes(data[:end])
        with pytest.raises(GGUFFormatError):
            read_header(tmp_path / "cut.gguf")


def test_bad_magic_and_version(tmp_path):
    data = bytearray(write_all_types(tmp_path / "types.gguf").read_bytes())
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        read_header(tmp_path / "magic.gguf")
    data[4:8] = (99).to_bytes(4, "little")
    (tmp_path / "version.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="version 99"):
        read_header(tmp_path / "version.gguf")


def _resident_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_released_tensor_leaves_memory_and_still_reads_the_same(tmp_path):
    """`release` drops a converted tensor's file pages (the load's peak no longer holds the whole file), and the
    read-only map faults them in again, unchanged, should anything read them later."""
    path = tmp_path / "big.gguf"
    values = np.random.default_rng(1).standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("big", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(path)
    (tensor,) = header.tensors
    assert float(tensor.data.sum()) == pytest.approx(float(values.sum()), rel=1e-4)
    assert _resident_kb(path) >= 8 * 1024
    header.release(tensor)
    assert _resident_kb(path) < 64
    np.testing.assert_array_equal(tensor.data, values)
