"""A fast reader of a GGUF file's header: its metadata key/values and tensor table, tensor data memory-mapped.

gguf-py's `GGUFReader` builds numpy views for every element of every metadata array (three per string),
which for a 49K-token vocabulary (tokens, merges, scores, token types) takes seconds. This reader walks the
same layout with `struct` over a memory map and turns each fixed-size array into one numpy array
(`np.frombuffer`), so the header of the embedded SmolLM2 file reads in a few tens of milliseconds.

The layout followed (ggml's docs/gguf.md; gguf-py `gguf_reader.py`, whose tensor views this matches):
magic "GGUF", u32 version (2 or 3), u64 tensor count, u64 key/value count; per key/value a string key
(u64 byte length + UTF-8), a u32 value type and the value (an array is a u32 element type, a u64 count and the
elements); per tensor a string name, u32 dimension count, u64 dimensions (fastest first), u32 ggml type and a
u64 offset into the data section, which starts at the next multiple of `general.alignment` (default 32).
Only little-endian files are read (llama.cpp writes no other kind by default).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

VERSIONS = (2, 3)

# fixed-size value types: struct format and numpy dtype (little-endian)
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# tensor types stored as plain values: the numpy dtype of gguf-py's view (others are bytes)
_VALUE_TENSORS: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.F64: np.dtype(np.float64),
    GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16),
    GGMLQuantizationType.I32: np.dtype(np.int32),
    GGMLQuantizationType.I64: np.dtype(np.int64),
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can parse (magic, version, truncation, value types)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` as GGUF lists it (fastest dimension first); `data` a read-only view of the file as
    gguf-py's ReaderTensor.data has it (values for F32/F16/..., else the raw blocks as uint8 [rows, row bytes])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed GGUF file: `metadata` {key: value} (strings, Python scalars, lists of strings, numpy arrays for
    arrays of fixed-size values) and the tensors in file order."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    file: mmap.mmap | None = field(default=None, repr=False, compare=False)

    def release(self, tensor: GGUFTensor) -> None:
        """Drops the file's pages under `tensor` from this process's memory (madvise MADV_DONTNEED) once its
        data has been converted: the map is read-only and file-backed, so a later read faults them in again from
        the page cache, but a load that reads every tensor once no longer holds the whole file resident on top
        of the weights it builds (about 90 MB of the embedded model's load-time peak)."""
        if self.file is None or not tensor.data.size or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data.__array_interface__["data"][0] - self._base_address()
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        self.file.madvise(mmap.MADV_DONTNEED, first, start + tensor.data.nbytes - first)

    def _base_address(self) -> int:
        return np.frombuffer(self.file, dtype=np.uint8).__array_interface__["data"][0]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Reads little-endian values from the mapped file at a moving offset; running past the end raises
    GGUFFormatError."""

    def __init__(self, file: mmap.mmap):
        self.file = file
        self.offset = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self.file, self.offset)
        except struct.error as exc:
            raise GGUFFormatError(f"truncated at byte {self.offset}") from exc
        self.offset += struct.calcsize(fmt)
        return values

    def take(self, nbytes: int) -> bytes:
        end = self.offset + nbytes
        if end > len(self.file):
            raise GGUFFormatError(f"truncated at byte {self.offset}: {nbytes} bytes wanted")
        data = self.file[self.offset:end]
        self.offset = end
        return data

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.take(length).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: the vocabulary and merges arrays, so one tight loop."""
        file, offset, size, values = self.file, self.offset, len(self.file), []
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if offset + 8 > size or offset + 8 + (length := unpack_length(file, offset)[0]) > size:
                raise GGUFFormatError(f"truncated in a string array at byte {offset}")
            values.append(file[offset + 8:offset + 8 + length].decode("utf-8"))
            offset += 8 + length
        self.offset = offset
        return values

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type][0])[0]
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            element_type, count = self.unpack("<IQ")
            if element_type in _SCALARS:
                dtype = _SCALARS[element_type][1]
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            if element_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(element_type) for _ in range(count)]  # arrays of arrays
        raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {self.offset}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parses the file's header; raises GGUFFormatError (a ValueError) if it is not a readable GGUF file."""
    path = Path(path)
    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            raise GGUFFormatError("the file is empty")
        file = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(file)
    magic, version = cursor.unpack("<II")
    if magic != GGUF_MAGIC:
        raise GGUFFormatError("GGUF magic invalid")
    if version not in VERSIONS:
        swapped = "a big-endian file, which this reader does not read" if version & 0xFFFF == 0 else "not supported"
        raise GGUFFormatError(f"GGUF version {version}: {swapped}")
    tensor_count, kv_count = cursor.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        (value_type,) = cursor.unpack("<I")
        if key in metadata:
            raise GGUFFormatError(f"duplicate metadata key {key!r}")
        metadata[key] = cursor.value(value_type)
    table = [_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    buffer = np.frombuffer(file, dtype=np.uint8)  # the tensors' views keep the map open
    tensors = [_tensor(buffer, data_start, *entry) for entry in table]
    if len({t.name for t in tensors}) != len(tensors):
        raise GGUFFormatError("duplicate tensor names")
    return GGUFHeader(path, version, metadata, tensors, file)


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    (dims,) = cursor.unpack("<I")
    shape = cursor.unpack(f"<{dims}Q")
    raw_type, offset = cursor.unpack("<IQ")
    return name, tuple(int(n) for n in shape), raw_type, offset


def _tensor(buffer: np.ndarray, data_start: int, name: str, shape: tuple[int, ...], raw_type: int,
            offset: int) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError as exc:
        raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {raw_type}") from exc
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    torch_order = tuple(reversed(shape))
    if tensor_type in _VALUE_TENSORS:
        dtype, data_shape = _VALUE_TENSORS[tensor_type], torch_order
    else:  # gguf-py's quant_shape_to_byte_shape: the last dimension counted in bytes
        if shape and shape[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: {shape[0]} values per row is not a multiple of {block}")
        dtype, data_shape = np.dtype(np.uint8), (*torch_order[:-1], shape[0] // block * block_bytes)
    count = int(np.prod(data_shape, dtype=np.int64))
    start = data_start + offset
    end = start + count * dtype.itemsize
    if end > len(buffer):
        raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
    return GGUFTensor(name, tensor_type, shape, buffer[start:end].view(dtype).reshape(data_shape))
