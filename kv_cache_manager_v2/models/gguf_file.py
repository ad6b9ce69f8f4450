"""A GGUF file's metadata and tensors, read in one pass over a memory map.

``gguf``'s own ``GGUFReader`` makes a NumPy view for every part of every field: Gemma 3's 262,144-entry
vocabulary alone is about a million views, ~20 s of a loaded 2-core machine before a weight is read, paid by every
process that loads the model (the tests start several). The layout itself is simple (little-endian GGUF v2/v3: a
header, key-value metadata, tensor descriptions, then the tensor data at an aligned offset), so this module walks
it with ``struct`` and returns plain values and read-only NumPy views of the mapping. ``gguf`` still supplies what
is worth not rewriting: the quantization types, their block sizes and ``dequantize``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

MAGIC: Final = 0x46554747  # b"GGUF" read as a little-endian uint32
DEFAULT_ALIGNMENT: Final = 32
_STRING: Final = 8
_ARRAY: Final = 9
_SCALARS: Final[dict[int, str]] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: ``data`` as ``GGUFReader`` gives it (the element type for plain types, shape outermost first;
    for quantized types uint8 rows of whole blocks), ready for ``gguf.quants.dequantize``."""

    name: str
    tensor_type: GGMLQuantizationType
    data: npt.NDArray[np.generic]


class _Cursor:
    """Reads values at a moving offset of the mapped file; a read past the end is a ``ValueError`` naming it."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.path = path
        self.offset = 0

    def unpack(self, layout: str) -> tuple[int, ...]:
        size = struct.calcsize(layout)
        if self.offset + size > len(self.data):
            raise ValueError(f"{self.path}: truncated GGUF file (needed {size} bytes at offset {self.offset})")
        values = struct.unpack_from(layout, self.data, self.offset)
        self.offset += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.data):
            raise ValueError(f"{self.path}: truncated GGUF string at offset {self.offset}")
        text = self.data[self.offset : end].decode("utf-8")
        self.offset = end
        return text

    def array(self, dtype: str, count: int) -> npt.NDArray[np.generic]:
        size = np.dtype(dtype).itemsize * count
        if self.offset + size > len(self.data):
            raise ValueError(f"{self.path}: truncated GGUF array at offset {self.offset}")
        values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset)
        self.offset += size
        return values

    def value(self, kind: int) -> object:
        """One metadata value of type ``kind``: a Python scalar, a ``str``, or a list of either."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            (item_kind,) = self.unpack("<I")
            (count,) = self.unpack("<Q")
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind in _SCALARS:
                return self.array(_SCALARS[item_kind], count).tolist()
            raise ValueError(f"{self.path}: unsupported GGUF array element type {item_kind}")
        layout = _SCALARS.get(kind)
        if layout is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        return self.array(layout, 1).tolist()[0]


def read_gguf_file(path: Path) -> tuple[dict[str, object], list[GgufTensor]]:
    """``(metadata, tensors)`` of a GGUF file; tensors are views of a read-only mapping kept alive by them."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(data, path)
    magic, version = cursor.unpack("<II")
    if magic != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic:#x})")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    num_tensors, num_fields = cursor.unpack("<QQ")
    metadata: dict[str, object] = {}
    for _ in range(num_fields):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        metadata[key] = cursor.value(kind)
    described: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(num_tensors):
        name = cursor.string()
        (num_dims,) = cursor.unpack("<I")
        dims = cursor.unpack(f"<{num_dims}Q")
        tensor_type, offset = cursor.unpack("<IQ")
        described.append((name, dims, tensor_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"{path}: general.alignment must be a positive integer, got {alignment!r}")
    start = -(-cursor.offset // alignment) * alignment
    plain = {
        GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F64: "<f8",
        GGMLQuantizationType.I8: "<i1", GGMLQuantizationType.I16: "<i2", GGMLQuantizationType.I32: "<i4",
        GGMLQuantizationType.I64: "<i8",
    }
    tensors: list[GgufTensor] = []
    for name, dims, raw_type, offset in described:
        ggml_type = GGMLQuantizationType(raw_type)
        count = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        cursor.offset = start + offset
        if ggml_type in plain:
            values = cursor.array(plain[ggml_type], count).reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            values = cursor.array("<u1", count * block_bytes // block).reshape(quant_shape_to_byte_shape(shape, ggml_type))
        tensors.append(GgufTensor(name, ggml_type, values))
    return metadata, tensors
