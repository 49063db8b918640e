"""Request bodies as JSON, decoded where they stall nothing; big answers written the same way.

``read_json`` decodes a body below ``BIG_BODY`` on the loop (about a millisecond for 1 MiB) and
hands a bigger one (declared, or counted as it arrives) to the parser actor's child process
(``actors/parser.py``), its pieces as they arrived, never joined here: decoding 25 MiB on the
loop, or on a worker thread (the C scanner holds the GIL), stalled every running stream
(decision 0019).  Both give the same value, or the same ``RequestInvalid`` (``codec.parse_json``
runs in the child too); ``read_body`` then validates a big one in a worker thread.
``write_json`` writes an answer the same way: on the loop when small, in the child when it
holds more than ``BIG_ANSWER`` numbers (``json_answer`` makes it a response).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import trio
from quart import Response, g, request
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from ..actors.parser import BIG_BODY, DumpJson, ParseJson, Parsed
from ..wire.codec import parse_json, structure
from ..wire.json_worker import dumps

__all__ = ["BIG_ANSWER", "json_answer", "read_body", "read_json", "write_json"]

_T = TypeVar("_T")

#: Answers with more numbers than this (embeddings, log-probabilities) are written by the
#: parser's child: 50,000 take ~25 ms of ``json.dumps``, all of it holding the GIL.
BIG_ANSWER = 50_000


async def read_body(wire_type: type[_T]) -> _T:
    """The request's JSON body, parsed and validated into ``wire_type`` (``wire/codec.py``): a
    ``RequestInvalid``, answered as a 400 in the caller's family, otherwise.

    A big body is validated in a worker thread: cattrs builds every object it holds in Python
    (24,000 messages: ~130 ms), which on the loop stalled every running stream for as long; in
    a thread the loop takes the GIL back within a switch interval (5 ms)."""
    value, big = await _decoded()
    if not big:
        return structure(value, wire_type)
    return await trio.to_thread.run_sync(structure, value, wire_type)


async def read_json() -> Any:
    """The request's body decoded as JSON (``codec.parse_json``: a ``RequestInvalid`` if it is
    not JSON this server takes), in the parser's child when it is ``BIG_BODY`` bytes or more."""
    value, _ = await _decoded()
    return value


async def _decoded() -> tuple[Any, bool]:
    """The body decoded, and whether it was big (``BIG_BODY`` bytes or more: decoded in the
    parser's child).  A body without a Content-Length (chunked) is counted as it arrives: one
    that is big goes to the child all the same, one past the limit is a 413 as soon as it is.
    A declared length over the limit never gets here: Quart refuses it (413) before a byte of
    it is read."""
    inbox, length = g.system.parser, request.content_length
    if inbox is None or (length is not None and length < BIG_BODY):
        return parse_json(await request.get_data()), False
    pieces, size = [], 0
    limit = getattr(request, "body_limit", request.max_content_length) or math.inf
    with trio.move_on_after(request.body_timeout or math.inf) as waited:
        async for piece in request.body:
            pieces.append(piece)
            size += len(piece)
            if size > limit:  # Quart counts only what is buffered, not what was taken from it
                raise RequestEntityTooLarge()
    if waited.cancelled_caught:
        raise RequestTimeout()
    if size < BIG_BODY:
        return parse_json(b"".join(pieces)), False
    return await _ask(inbox, lambda reply: ParseJson(pieces, reply)), True


async def write_json(value: Any, *, big: bool) -> bytes:
    """``value`` as compact UTF-8 JSON (numpy arrays as lists of numbers): in the parser's child
    when ``big`` (``json.dumps`` holds the GIL throughout: ~0.4 s for 2,048
    embeddings), on the loop otherwise."""
    inbox = g.system.parser
    if not big or inbox is None:
        return dumps(value).encode("utf-8")
    text: bytes = await _ask(inbox, lambda reply: DumpJson(value, reply))
    return text


async def json_answer(body: Any, *, numbers: int, status: int = 200) -> Response:
    """``body`` as a JSON response, written off the loop when it holds more than
    ``BIG_ANSWER`` numbers."""
    text = await write_json(body, big=numbers > BIG_ANSWER)
    return Response(text, status=status, content_type="application/json")


async def _ask(inbox: trio.MemorySendChannel[Any], job: Any) -> Any:
    """Send the parser ``job(reply)``; its value, or raise its error."""
    reply_send, reply_recv = trio.open_memory_channel[Parsed](1)
    with reply_recv:
        await inbox.send(job(reply_send))
        answer = await reply_recv.receive()
    if answer.error is not None:
        raise answer.error
    return answer.value
