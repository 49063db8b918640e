"""Read a GGUF file: its key/value metadata, its tensor table, and each tensor's bytes.

``gguf.GGUFReader`` builds a numpy view per array element, which costs 10-40 s for the 150k-260k
token vocabularies of Llama 3, Qwen 2, Command-R or Gemma. This reader parses the header with
``struct`` from one ``bytes`` buffer (about 0.2 s for the same vocabularies) and maps tensor data
with ``numpy.memmap``, laid out as ``GGUFReader`` lays it out, so ``gguf.quants.dequantize``
takes it as is. Anything it cannot parse (a wrong magic, a version it does not know, a header or
tensor running past the end of the file) raises :class:`GGUFFormatError` with what was wrong.

Format (little-endian, version 2 or 3): ``GGUF``, u32 version, u64 tensor count, u64 key count;
the keys (string, u32 type, value); the tensor infos (name, u32 n_dims, u64 dims, u32 type, u64
offset); padding to ``general.alignment`` (default 32); the tensor data.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

__all__ = ["GGUFFile", "GGUFFormatError", "TensorInfo", "read_gguf"]

_GQT = gguf.GGMLQuantizationType

# GGUF value types -> struct format of a scalar (strings, arrays and bools are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
# Tensor types whose elements are plain numbers (GGUFReader gives these their numpy dtype).
_PLAIN = {_GQT.F32: np.float32, _GQT.F16: np.float16, _GQT.F64: np.float64, _GQT.I8: np.int8}
_PLAIN |= {_GQT.I16: np.int16, _GQT.I32: np.int32, _GQT.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands, or it is truncated or corrupt."""


class _ShortBuffer(Exception):
    """The header goes on past the bytes read so far."""


@attrs.frozen
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  #: GGUF order: the fastest-varying dimension first (``(in, out)`` for a matrix)
    tensor_type: gguf.GGMLQuantizationType
    offset: int  #: absolute file offset of the data
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise _ShortBuffer
        value = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.data):
            raise _ShortBuffer
        raw = self.data[self.pos : end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (the hot loop: vocabularies and merges)."""
        data, pos, unpack, out = self.data, self.pos, struct.unpack_from, []
        append, limit = out.append, len(data)
        for _ in range(count):
            if pos + 8 > limit:
                raise _ShortBuffer
            (n,) = unpack("<Q", data, pos)
            pos += 8
            if pos + n > limit:
                raise _ShortBuffer
            raw = data[pos : pos + n]
            pos += n
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(raw.decode("utf-8", errors="replace"))
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take("<" + _SCALARS[kind])
        if kind == _BOOL:
            return bool(self.take("<B"))
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind])
                end = self.pos + count * dtype.itemsize
                if end > len(self.data):
                    raise _ShortBuffer
                values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            if item_kind == _STRING:
                return self._strings(count)
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {kind}")


@attrs.frozen
class GGUFFile:
    """A parsed GGUF: ``metadata`` (key -> Python value), ``tensors`` in file order."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The raw data of ``tensor`` as ``gguf.GGUFReader`` shapes it (a read-only memory map).

        Plain types (F32, F16, ...) come as their numpy dtype in ``reversed(shape)``; block-quantized
        types (and BF16) as ``uint8`` rows of packed blocks, ready for ``gguf.quants.dequantize``.
        """
        dims = tuple(reversed(tensor.shape))
        if tensor.tensor_type in _PLAIN:
            dtype = np.dtype(_PLAIN[tensor.tensor_type]).newbyteorder("<")
            count = tensor.n_elements
        else:
            dtype, count = np.dtype(np.uint8), tensor.n_bytes
            dims = gguf.quant_shape_to_byte_shape(dims, tensor.tensor_type)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=tensor.offset, shape=(count,)).reshape(dims)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and tensor table of the GGUF at ``path``.

    Raises:
        GGUFFormatError: not a GGUF (wrong magic), an unsupported version or byte order, a header
            that runs past the end of the file, an unknown tensor type, duplicate tensor names, or
            tensor data that would lie beyond the end of the file (a truncated download).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise GGUFFormatError(f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
        if len(head) < 24:
            raise GGUFFormatError("the header runs past the end of the file")
        version = struct.unpack_from("<I", head, 4)[0]
        if version > 0xFFFF:
            raise GGUFFormatError("a big-endian GGUF; only little-endian files are supported")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
        # The header is usually a few MB (the vocabulary); read in growing chunks until it parses.
        chunk = 1 << 22
        while True:
            f.seek(0)
            data = f.read(chunk)
            try:
                return _parse(path, data, size)
            except _ShortBuffer:
                if len(data) >= size:
                    raise GGUFFormatError(f"truncated: the header runs past the end of the file ({size:,} bytes)") from None
                chunk *= 4


def _parse(path: Path, data: bytes, size: int) -> GGUFFile:
    cursor = _Cursor(data)
    cursor.pos = 8
    n_tensors, n_keys = cursor.take("<Q"), cursor.take("<Q")
    if n_tensors > size or n_keys > size:
        raise GGUFFormatError(f"implausible counts ({n_tensors} tensors, {n_keys} keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))

    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.take("<I")
        if n_dims > 8:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cursor.take("<Q") for _ in range(n_dims))
        raw_type, offset = cursor.take("<I"), cursor.take("<Q")
        infos.append((name, shape, raw_type, offset))

    alignment = int(metadata.get("general.alignment", 32)) or 32
    start = cursor.pos + (-cursor.pos % alignment)
    tensors, names = [], set()
    for name, shape, raw_type, offset in infos:
        try:
            qtype = _GQT(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has an unknown type {raw_type}") from None
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        names.add(name)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[0] % block:
            raise GGUFFormatError(f"tensor {name!r} of type {qtype.name} has rows of {shape[0]}, not whole blocks")
        n_bytes = n_elements // block * type_size
        begin = start + offset
        if begin + n_bytes > size:
            raise GGUFFormatError(
                f"truncated: tensor {name!r} needs bytes up to {begin + n_bytes:,} but the file has {size:,}"
            )
        tensors.append(TensorInfo(name=name, shape=shape, tensor_type=qtype, offset=begin, n_bytes=n_bytes))
    return GGUFFile(path=path, metadata=metadata, tensors=tuple(tensors))
