"""Write a safetensors file one tensor at a time, so a conversion never holds the whole model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

__all__ = ["SafetensorsWriter"]

_SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "uint8": "U8",
}


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time (a context manager).

    The header (names, dtypes, offsets) must come first but is only known at the end, so tensor bytes
    go to a scratch file next to the target and are appended after the header when the block exits
    without an error.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._scratch_path = path.with_name(path.name + ".data")
        self._scratch: BinaryIO = self._scratch_path.open("wb")
        self._header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        self._offset = 0

    def add(self, name: str, array: np.ndarray | mx.array) -> None:
        dtype = str(array.dtype).removeprefix("mlx.core.")
        if dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"no safetensors dtype for {dtype}")
        data = memoryview(array)  # both array types export a C-contiguous buffer
        self._scratch.write(data)
        end = self._offset + data.nbytes
        self._header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(array.shape),
            "data_offsets": [self._offset, end],
        }
        self._offset = end

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._scratch.close()
        if exc_type is None:
            self._finish()
        self._scratch_path.unlink()

    def _finish(self) -> None:
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the format aligns the data section to 8 bytes
        with self._path.open("wb") as out, self._scratch_path.open("rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
