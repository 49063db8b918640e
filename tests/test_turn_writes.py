"""A streamed body's pieces: what one wake-up of the turn finds queued (a step's news, the
last token with its ending) is framed into one piece, one socket write; replies that arrive
apart go out apart."""

from __future__ import annotations

import trio
import trio.testing

from turbospark.messages import Delta, Failed, Finished, TextPrompt
from turbospark.errors import ShuttingDown
from turbospark.model.backend import SamplingParams
from turbospark.routes._turn import Turn, TurnPlan, framed
from turbospark.turns.turn_stream import TurnStream


class Names:
    """A framer that frames each event as its class's name."""

    def opening(self) -> list[bytes]:
        return [b"open;"]

    def feed(self, event: object) -> list[bytes]:
        return [type(event).__name__.encode() + b";"]

    def tick(self) -> list[bytes]:
        return [b"tick;"]


def turn(replies: trio.MemoryReceiveChannel) -> Turn:
    plan = TurnPlan("m", TextPrompt("hi"), SamplingParams(max_tokens=4))
    return Turn(plan, 1, None, replies, TurnStream(retryable=False))  # type: ignore[arg-type]


def finished(tokens: int) -> Finished:
    return Finished("length", "MaxTokens", None, 3, tokens, 0)


async def pieces(body) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [piece async for piece in body]


async def test_what_is_queued_goes_out_as_one_piece() -> None:
    send, recv = trio.open_memory_channel(16)
    for message in (Delta("a"), Delta("b"), Delta("c"), finished(3)):
        send.send_nowait(message)
    body = framed(turn(recv), Names(), keepalive=15.0, error=lambda exc: [b"error;"])
    assert await pieces(body) == [b"open;", b"Text;Text;Text;Finish;Usage;"]
    assert recv.statistics().open_receive_channels == 0  # the turn closed its replies


async def test_replies_that_arrive_apart_go_out_apart() -> None:
    send, recv = trio.open_memory_channel(16)
    got: list[bytes] = []

    async def read() -> None:
        async for piece in framed(turn(recv), Names(), keepalive=15.0, error=lambda exc: [b"error;"]):
            got.append(piece)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for message in (Delta("a"), Delta("b")):
            await trio.testing.wait_all_tasks_blocked()
            send.send_nowait(message)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(Delta("c"))
        send.send_nowait(finished(3))
    assert got == [b"open;", b"Text;", b"Text;", b"Text;Finish;Usage;"]


async def test_a_failure_queued_behind_tokens_ends_the_piece_they_share() -> None:
    send, recv = trio.open_memory_channel(16)
    for message in (Delta("a"), Failed(ShuttingDown()), Delta("never")):
        send.send_nowait(message)
    body = framed(turn(recv), Names(), keepalive=15.0, error=lambda exc: [type(exc).__name__.encode() + b";"])
    assert await pieces(body) == [b"open;", b"Text;ShuttingDown;"]
