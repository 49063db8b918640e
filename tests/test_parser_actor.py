"""The parser actor decodes big request bodies, and writes big answers, in a child process: the
same value, and the same refusal, as ``codec.parse_json`` on the loop, and the same text as
``json_worker.dumps`` on the loop; pieces are joined in order; a child that dies fails the one job
it held, and the next job gets a new child; a requester that has left is not answered and holds
nothing up."""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

import numpy as np

from turbospark.actors.parser import DumpJson, ParseJson, Parsed, parser
from turbospark.errors import GenerationFailed, RequestInvalid
from turbospark.wire.codec import parse_json

from ._support import json_children


async def ask(inbox: trio.MemorySendChannel[ParseJson], body: bytes, pieces: int = 3) -> Parsed:
    step = max(1, len(body) // pieces)
    send, recv = trio.open_memory_channel[Parsed](1)
    with recv:
        await inbox.send(ParseJson([body[i:i + step] for i in range(0, len(body), step)], send))
        with trio.fail_after(60):
            return await recv.receive()


@pytest.fixture
async def inbox(nursery: trio.Nursery):
    send, recv = trio.open_memory_channel[ParseJson](8)
    await nursery.start(parser, recv)
    yield send
    nursery.cancel_scope.cancel()


async def test_the_child_gives_what_parse_json_gives(inbox) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "é" + "word " * 300_000}],
                       "n": 2, "t": 0.5, "ok": True, "none": None}).encode()
    answer = await ask(inbox, body, pieces=17)
    assert answer.error is None and answer.value == parse_json(body)
    for bad in (b'{"a": NaN}', b'{"a": 1', b'[' * 100 + b']' * 100, b'{"a": "\\ud800"}', b"\xff"):
        with pytest.raises(RequestInvalid) as on_the_loop:
            parse_json(bad)
        answer = await ask(inbox, bad, pieces=2)
        assert isinstance(answer.error, RequestInvalid), bad
        assert (answer.error.message, answer.error.param) == (on_the_loop.value.message, on_the_loop.value.param)


async def test_the_child_writes_what_dumps_writes_on_the_loop(inbox) -> None:
    from turbospark.wire.json_worker import dumps

    vectors = np.random.default_rng(0).standard_normal((300, 384)).astype(np.float32)
    value = {"object": "list", "model": "é", "data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
    send, recv = trio.open_memory_channel[Parsed](1)
    with recv:
        await inbox.send(DumpJson(value, send))
        answer = await recv.receive()
    assert answer.value == dumps(value).encode("utf-8")
    decoded = json.loads(answer.value)
    assert decoded["data"][7]["embedding"] == vectors[7].tolist()  # every float32 value exactly
    send, recv = trio.open_memory_channel[Parsed](1)
    with recv:
        await inbox.send(DumpJson({"x": object()}, send))  # cannot be pickled: fails alone
        assert isinstance((await recv.receive()).error, GenerationFailed)
    assert (await ask(inbox, b'{"a": 1}')).value == {"a": 1}


async def test_a_dead_child_fails_its_job_alone_and_a_left_requester_holds_nothing(inbox) -> None:
    assert (await ask(inbox, b'{"a": 1}')).value == {"a": 1}  # the child is up
    children = json_children()
    assert len(children) == 1
    os.kill(children[0], signal.SIGKILL)
    failed = await ask(inbox, b'{"a": 2}')
    assert isinstance(failed.error, GenerationFailed) and "error id" in failed.error.message
    assert (await ask(inbox, b'{"a": 3}')).value == {"a": 3}  # a new child
    # a requester that left before its answer: the next job is answered all the same
    send, recv = trio.open_memory_channel[Parsed](1)
    recv.close()
    await inbox.send(ParseJson([b'{"a": 4}'], send))
    assert (await ask(inbox, b'{"a": 5}')).value == {"a": 5}
