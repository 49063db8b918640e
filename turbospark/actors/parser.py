"""The parser actor: JSON too big for the event loop (request bodies to decode, answers to
write) is handled in a child process.

    parser           inbox: ParseJson | DumpJson
    └── one child process (``python -m turbospark.wire.json_worker``), started for the first
        big body and again after one dies; killed at shutdown

Why a process: the C JSON scanner holds the GIL for its whole run (~30 ms for 25 MiB, plus the
bytes-to-text decode), wherever it runs, so on the loop or on a worker thread every running
stream waits for it (measured, decision 0019).  The child decodes and checks the body with the
same ``codec.parse_json``; the loop only writes the body's pieces to a pipe as they arrived and
reads back the value, pickled (a large string comes back as one copy).  The same holds for
writing: ``json.dumps`` of 2,048 embeddings takes ~0.4 s, all of it holding the GIL; the
value goes to the child pickled (numpy arrays as their bytes) and comes back as JSON text.

Jobs run one at a time, in order.  A job runs to its end even if its requester has left (its
reply channel closed: nobody is answered), so the pipe stays in step.  A child that dies, or
answers something that cannot be read, fails the job it held with a ``GenerationFailed`` (the
log line carries its error id); the next job starts a new child.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ..errors import GenerationFailed, RequestInvalid

__all__ = ["BIG_BODY", "DumpJson", "ParseJson", "Parsed", "parser"]

log = logging.getLogger(__name__)

#: Bodies of at least this many bytes are decoded by the child (below it, on the loop: a
#: 1 MiB body decodes in about a millisecond, less than the pipe round trip costs)
BIG_BODY = 1 << 20
_HEADER = struct.Struct(">Q")
_PIPE = 1 << 20  # pipe buffer asked for (Linux: up to /proc/sys/fs/pipe-max-size, 1 MiB by default)


@attrs.frozen
class Parsed:
    """A job's answer: the decoded value (``ParseJson``) or the JSON text (``DumpJson``), or why
    there is none."""

    value: Any = None
    error: RequestInvalid | GenerationFailed | None = None


@attrs.frozen
class ParseJson:
    pieces: Sequence[bytes]  # the body, in the pieces it arrived in
    reply: trio.MemorySendChannel[Parsed]


@attrs.frozen
class DumpJson:
    """``value`` written as JSON (numpy arrays as lists of numbers); ``Parsed.value`` is the
    UTF-8 text."""

    value: Any
    reply: trio.MemorySendChannel[Parsed]


class _Child:
    def __init__(self, process: trio.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin, self.stdout = process.stdin, process.stdout
        for stream in (self.stdin, self.stdout):
            _widen(stream)

    async def run(self, kind: bytes, pieces: Sequence[bytes]) -> Parsed:
        """One frame to the child (``json_worker``), and its answer."""
        await self.stdin.send_all(kind + _HEADER.pack(sum(len(p) for p in pieces)))
        for piece in pieces:
            await self.stdin.send_all(piece)
        head = await self._exactly(1 + _HEADER.size)
        status, (size,) = head[:1], _HEADER.unpack(head[1:])
        payload = await self._exactly(size)
        if status == b"o":
            return Parsed(value=pickle.loads(payload) if kind == b"p" else bytes(payload))
        if status == b"r":
            message, param = pickle.loads(payload)
            return Parsed(error=RequestInvalid(message, param=param))
        raise RuntimeError(f"the JSON child answered status {status!r}")

    async def _exactly(self, size: int) -> bytearray:
        out = bytearray()
        while len(out) < size:
            chunk = await self.stdout.receive_some(min(size - len(out), _PIPE))
            if not chunk:
                raise RuntimeError("the JSON child ended")
            out += chunk
        return out


def _widen(stream: Any) -> None:
    """Ask for a 1 MiB pipe buffer: fewer loop turns per body (best effort)."""
    try:
        import fcntl

        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE)
    except (OSError, AttributeError, ImportError):
        pass


async def parser(inbox: trio.MemoryReceiveChannel[ParseJson | DumpJson], *, task_status: trio.TaskStatus[None]) -> None:
    child: _Child | None = None
    task_status.started()
    try:
        async for job in inbox:
            what = "decoding the request body" if isinstance(job, ParseJson) else "writing the answer"
            try:
                frame = (b"p", job.pieces) if isinstance(job, ParseJson) else (
                    b"d", [pickle.dumps(job.value, protocol=pickle.HIGHEST_PROTOCOL)])
            except Exception:  # a value that cannot be pickled: its job alone, the child is fine
                failed = GenerationFailed.new(f"{what} failed")
                log.exception("%s failed (error id %s)", what, failed.error_id)
                _answer(job, Parsed(error=failed))
                continue
            try:
                if child is None:
                    child = _Child(await trio.lowlevel.open_process(
                        [sys.executable, "-m", "turbospark.wire.json_worker"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    ))
                answer = await child.run(*frame)
            except Exception:
                failed = GenerationFailed.new(f"{what} failed")
                log.exception("the JSON child failed %s (error id %s); a new one takes the next job",
                              what, failed.error_id)
                answer = Parsed(error=failed)
                if child is not None:
                    child.process.kill()
                    child = None
            _answer(job, answer)
    finally:
        if child is not None:
            child.process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await child.process.wait()


def _answer(job: ParseJson | DumpJson, answer: Parsed) -> None:
    try:
        job.reply.send_nowait(answer)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # its requester has left
