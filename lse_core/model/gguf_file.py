"""A GGUF file's header, read and checked against the file itself.

    header = read_gguf_header(path, mapping)   # mapping: the whole file, memory-mapped
    header.metadata                            # key -> int | float | bool | str | list
    header.tensors                             # [GGUFTensor(name, qtype, dims, offset, nbytes)]

Every count, length, offset and size is compared with the bytes the file has before anything is read
or allocated for it, so a truncated, damaged or hostile header fails with a StartupError naming the
file and the field: never a huge allocation, a numpy error or a loop the header alone makes long.
The layout (ggml's docs/gguf.md), little-endian:

    "GGUF" | version u32 (2 or 3) | tensor count u64 | metadata count u64
    metadata:  key | value type u32 | value             (a string: u64 byte length + UTF-8)
    tensors:   name | n_dims u32 | dims u64 x n_dims (innermost first) | type u32 | offset u64
    data:      from the first multiple of general.alignment (default 32) after the tensor table;
               each tensor's offset counts from there
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from lse_core.errors import StartupError

# struct (and numpy) formats of the scalar value types
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}
_MIN_ENTRY_BYTES = 8 + 4 + 1        # a metadata entry: key length, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8   # a tensor: name length, n_dims, one dim, type, offset
_MAX_DIMS = 4                       # ggml's GGML_MAX_DIMS


class GGUFTensor(NamedTuple):
    name: str
    qtype: str          # GGMLQuantizationType name: F32, Q4_0...
    dims: list[int]     # GGUF order: innermost first
    offset: int         # of its first byte in the file
    nbytes: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Reader:
    """The header front to back: each read first checks that the file has the bytes."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def error(self, what: str) -> StartupError:
        return StartupError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise self.error(f"{what} at byte {self.pos} would need {n} bytes, past the file's end "
                             f"({len(self.buf)} bytes): the file is truncated or corrupt")

    def take(self, n: int, what: str) -> int:
        """Where the next ``n`` bytes start; the reader moves past them."""
        self.need(n, what)
        self.pos += n
        return self.pos - n

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", f"the length of {what}")
        start = self.take(length, f"{what} ({length} bytes)")
        try:
            return self.buf[start:start + length].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} at byte {start} is not UTF-8 ({e.reason})") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type], what)
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type != GGUFValueType.ARRAY:
            raise self.error(f"{what} has value type {value_type}, which is not a GGUF type")
        item_type = self.scalar("<I", f"the item type of {what}")
        count = self.scalar("<Q", f"the length of {what}")
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type])
            start = self.take(count * dtype.itemsize, f"{what} ({count} values)")
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if item_type == GGUFValueType.STRING:
            self.need(count * 8, f"{what} ({count} strings)")   # each at least its length field
            return [self.string(f"{what}[{i}]") for i in range(count)]
        raise self.error(f"{what} is an array of value type {item_type}; LSE reads arrays of numbers and strings")


def read_gguf_header(path: str, buf: mmap.mmap) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file ``buf`` maps; StartupError if any of it does not fit."""
    reader = _Reader(buf, path)
    magic = buf[:4]
    if magic != b"GGUF":
        raise reader.error(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    reader.pos = 4
    version = reader.scalar("<I", "the version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise reader.error("a big-endian GGUF file; LSE reads little-endian ones" if swapped in (2, 3)
                           else f"GGUF version {version}; LSE reads versions 2 and 3")
    n_tensors = reader.scalar("<Q", "the tensor count")
    n_entries = reader.scalar("<Q", "the metadata count")
    reader.need(n_entries * _MIN_ENTRY_BYTES + n_tensors * _MIN_TENSOR_BYTES,
                f"the header's {n_entries} metadata entries and {n_tensors} tensors")

    metadata: dict[str, Any] = {}
    for i in range(n_entries):
        key = reader.string(f"metadata key {i}")
        if key in metadata:
            raise reader.error(f"metadata key {key!r} appears twice")
        metadata[key] = reader.value(reader.scalar("<I", f"the value type of metadata {key}"), f"metadata {key}")

    table = []
    for i in range(n_tensors):
        name = reader.string(f"the name of tensor {i}")
        n_dims = reader.scalar("<I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise reader.error(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
        dims = [reader.scalar("<Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        type_number = reader.scalar("<I", f"the type of tensor {name!r}")
        table.append((name, dims, type_number, reader.scalar("<Q", f"the offset of tensor {name!r}")))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise reader.error(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-reader.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_number, offset in table:
        if name in tensors:
            raise reader.error(f"tensor {name!r} appears twice")
        tensors[name] = _tensor(reader, name, dims, type_number, data_start + offset, alignment)
    return GGUFHeader(metadata, list(tensors.values()))


def _tensor(reader: _Reader, name: str, dims: list[int], type_number: int, offset: int, alignment: int) -> GGUFTensor:
    """A tensor table entry, checked: a known type, whole blocks, aligned, and its data inside the file."""
    try:
        qtype = GGMLQuantizationType(type_number)
    except ValueError:
        raise reader.error(f"tensor {name!r} has type number {type_number}, which is not a ggml type") from None
    if 0 in dims:
        raise reader.error(f"tensor {name!r} has a zero dimension ({dims})")
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if dims[0] % block_values:
        raise reader.error(f"tensor {name!r} has rows of {dims[0]} values, not whole {qtype.name} blocks "
                           f"of {block_values}")
    if offset % alignment:
        raise reader.error(f"tensor {name!r} data starts at byte {offset}, not a multiple of the alignment "
                           f"{alignment}")
    nbytes = math.prod(dims) // block_values * block_bytes   # Python ints: a product cannot overflow
    end, size = offset + nbytes, len(reader.buf)
    if end > size:
        raise reader.error(f"tensor {name!r} data ends at byte {end} past the file's end ({size} bytes): "
                           "the file is truncated")
    return GGUFTensor(name, qtype.name, dims, offset, nbytes)
