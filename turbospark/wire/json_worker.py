"""The JSON child process (``python -m turbospark.wire.json_worker``), for the parser actor
(``actors/parser.py``): JSON too big to decode or write on the server's event loop.

A frame each way on stdin/stdout.  In: a kind byte, an 8-byte big-endian length, the payload:

- ``p``: a request body to decode;
- ``d``: a pickled value to write as JSON (numpy arrays in it are written as lists of numbers).

Out: one status byte, an 8-byte length, then the payload:

- ``o``: the decoded and checked value (``codec.parse_json``, the same checks as on the loop),
  pickled; or the JSON written, as UTF-8;
- ``r``: the body was refused: the ``RequestInvalid``'s message and param, pickled as a pair;
- ``f``: something else failed here (no detail: the server logs its own error id).

No Trio: one frame at a time, in order, until stdin closes; at a lower CPU priority than the
server (nice 10), so that on a busy machine the model threads run before a parse.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

from ..errors import RequestInvalid
from .codec import parse_json

__all__ = ["HEADER", "dumps", "main", "read_frame"]

HEADER = struct.Struct(">Q")


def dumps(value: Any) -> str:
    """``value`` as compact JSON text (non-ASCII kept), numpy arrays as lists of numbers."""
    return json.dumps(value, ensure_ascii=False, default=_plain)


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)  # a numpy array or scalar
    if tolist is None:
        raise TypeError(f"{type(value).__name__} is not JSON serializable")
    return tolist()


def read_frame(stream: BinaryIO) -> tuple[bytes, bytearray] | None:
    """One frame (its kind and payload); None at the end of the stream."""
    head = stream.read(1 + HEADER.size)
    if len(head) < 1 + HEADER.size:
        return None
    (size,) = HEADER.unpack(head[1:])
    body = bytearray(size)
    view, got = memoryview(body), 0
    while got < size:
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            return None
        got += n
    return head[:1], body


def answer(kind: bytes, payload: bytearray) -> tuple[bytes, bytes]:
    try:
        if kind == b"d":
            return b"o", dumps(pickle.loads(payload)).encode("utf-8")
        return b"o", pickle.dumps(parse_json(bytes(payload)), protocol=pickle.HIGHEST_PROTOCOL)
    except RequestInvalid as exc:
        return b"r", pickle.dumps((exc.message, exc.param))
    except Exception:  # noqa: BLE001 - the server answers it with an error id of its own
        return b"f", b""


def main() -> None:
    try:  # the model threads come first: a body waits a little longer, no stream does
        os.nice(10)
    except (OSError, AttributeError):
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := read_frame(stdin)) is not None:
        status, payload = answer(*frame)
        del frame
        stdout.write(status + HEADER.pack(len(payload)))
        stdout.write(payload)
        stdout.flush()


if __name__ == "__main__":
    main()
