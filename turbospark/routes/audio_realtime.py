"""``GET /v1/audio/transcriptions/realtime``: realtime transcription over a WebSocket.

Handshake: ``?model=ID[&encoding=s16le|f32le][&language=xx][&vad=true]``, unknown keys refused;
the API key comes from the upgrade request's headers, and its ``Origin`` and ``Host`` pass the
same checks as every route (``--allowed-origins``; loopback names on a loopback bind).  Frames: binary PCM at
16 kHz mono; text ``{"type":"commit"}``, ``{"type":"reset"}``, ``{"type":"session","vad":bool}``.
The session's state is ``audio/realtime.py`` (sans-io); this handler carries out its actions:

    handler (Quart-Trio cancels it when the client hangs up)
    ├── receive loop      frames in (idle timeout), session actions out; it waits while
    │                     COMMITS_WAITING commits wait (back-pressure on the client)
    ├── committer         commits in order: transcribe, then {"type":"complete",...}
    └── partial × ≤1      a hypothesis of the segment so far; a commit cancels it

Every transcription's reply channel lives in the handler's scope: a client that hangs up (or
a commit that supersedes a partial) closes it, and the worker stops at its next step.  The
session holds a lease on its model from the handshake until the socket closes, as every request
holds its model: neither ``keep_alive`` nor eviction unloads it under an open session.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import trio
from quart import Blueprint, current_app, websocket

from ..audio.messages import AudioRequest, Transcribe, WorkDone, WorkFailed
from ..audio.realtime import Commit, Partial, RealtimeLimits, Send, Session
from ..audio.wire import check_language, segments_json
from ..errors import RequestInvalid, TurboSparkError
from ..web.app import system
from ._audio import receive, resolve_audio, submit

blueprint = Blueprint("audio_realtime", __name__)

_KEYS = {"model", "encoding", "language", "vad"}
COMMITS_WAITING = 64  # commits a session holds before it stops reading frames


class TooManySessions(TurboSparkError):
    status = 429
    type = "invalid_request_error"
    retry_after = 2


def _vad_detector() -> Any:
    try:
        import webrtcvad
    except ImportError:
        return None
    vad = webrtcvad.Vad(2)
    return lambda frame: vad.is_speech(frame, 16000)


def _limits() -> RealtimeLimits:
    s = system().settings
    return RealtimeLimits(
        max_frame_bytes=s.max_audio_frame_bytes,
        idle_seconds=s.realtime_idle_seconds,
        max_session_seconds=s.realtime_max_seconds,
    )


async def observed(open_socket: Callable[[], Awaitable[None]]) -> None:
    """A realtime socket's life, told to the observer as one audio request: 101, or the status
    of what refused it (this socket's and ``/v1/realtime``'s alike)."""
    began = time.monotonic()
    status = 101
    try:
        await open_socket()
    except TurboSparkError as exc:
        status = exc.status
        raise
    finally:
        system().emit(AudioRequest("realtime", status, time.monotonic() - began))


@contextmanager
def session_slot(limits: RealtimeLimits) -> Iterator[None]:
    """One of the realtime sessions the server holds at once (``max_sessions``, shared by this
    socket and ``/v1/realtime``); a retryable 429 beyond."""
    app: Any = current_app
    if app.realtime_sessions >= limits.max_sessions:
        raise TooManySessions(f"{limits.max_sessions} realtime sessions are open; retry shortly")
    app.realtime_sessions += 1
    try:
        yield
    finally:
        app.realtime_sessions -= 1


@blueprint.websocket("/v1/audio/transcriptions/realtime")
async def realtime() -> None:
    await observed(_realtime)


async def _realtime() -> None:
    args = websocket.args
    for key in args:
        if key not in _KEYS:
            raise RequestInvalid(f'the query parameter "{key}" is not supported', param=key)
    model = (args.get("model") or "").strip()
    if not model:
        raise RequestInvalid("model is required", param="model")
    encoding = args.get("encoding") or "s16le"
    if encoding not in ("s16le", "f32le"):
        raise RequestInvalid(f'encoding must be s16le or f32le, not "{encoding}"', param="encoding")
    language = check_language(args.get("language"))
    vad_text = (args.get("vad") or "").lower()
    if vad_text not in ("", "true", "1", "false", "0"):
        raise RequestInvalid(f'vad must be true or false, not "{vad_text}"', param="vad")
    detector = _vad_detector()
    if vad_text in ("true", "1") and detector is None:
        raise RequestInvalid("voice activity detection is not available on this server", param="vad")
    limits = _limits()
    with session_slot(limits), ExitStack() as held:  # the session's lease on its model, until it closes
        info = await resolve_audio(model, "speech_to_text", scope=held)
        # the web page offers "turbospark" (and its key as another subprotocol, web/app.py)
        await websocket.accept(subprotocol="turbospark" if "turbospark" in websocket.requested_subprotocols else None)
        session = Session(encoding, vad=vad_text in ("true", "1"), is_speech=detector, limits=limits)
        await _serve(session, info.id, language, limits)


async def _serve(session: Session, model: str, language: str | None, limits: RealtimeLimits) -> None:
    send_lock = trio.Lock()
    commits_send, commits_recv = trio.open_memory_channel[Commit](COMMITS_WAITING)
    partial_scope: list[trio.CancelScope] = []  # the partial in flight, if any
    closing = trio.Event()

    async def send(message: dict[str, Any]) -> None:
        async with send_lock:
            await websocket.send(json.dumps(message, ensure_ascii=False))

    async def transcribe(audio: Any, endpoint_scope: ExitStack) -> WorkDone | WorkFailed:
        try:
            recv = await submit(endpoint_scope, request_id=-1, model=model, endpoint="realtime",
                                args=Transcribe(audio, language))  # fmt: skip
            reply = await receive(recv)
        except TurboSparkError as exc:
            return WorkFailed(exc)
        assert isinstance(reply, (WorkDone, WorkFailed))
        return reply

    async def committer() -> None:
        async for commit in commits_recv:
            with ExitStack() as scope:
                reply = await transcribe(commit.audio, scope)
            if isinstance(reply, WorkFailed):
                await send({"type": "error", "segment_id": commit.segment_id,
                            "status": reply.error.status, "message": reply.error.message})  # fmt: skip
                continue
            t = reply.transcript
            assert t is not None
            await send({
                "type": "complete", "segment_id": commit.segment_id, "text": t.text, "language": t.language,
                "segments": segments_json(t.segments), "auto": commit.auto,
            })  # fmt: skip

    async def hypothesis(p: Partial, segment_id: int, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            partial_scope.append(scope)
            task_status.started()
            try:
                with ExitStack() as stack:
                    reply = await transcribe(p.audio, stack)
                if isinstance(reply, WorkDone) and reply.transcript is not None:
                    await send({"type": "partial", "segment_id": segment_id, "text": reply.transcript.text,
                                "audio_end_ms": p.audio_end_ms})
            finally:
                partial_scope.remove(scope)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(committer)
        with trio.move_on_after(limits.max_session_seconds) as session_deadline:
            while not closing.is_set():
                with trio.move_on_after(limits.idle_seconds) as idle:
                    data = await websocket.receive()
                if idle.cancelled_caught:
                    await send({"type": "error", "message": "idle timeout"})
                    break
                actions = session.binary(data) if isinstance(data, bytes) else session.text(data)
                for action in actions:
                    if isinstance(action, Send):
                        await send(action.message)
                        if action.close:
                            closing.set()
                            break
                    elif isinstance(action, Commit):
                        for scope in partial_scope:
                            scope.cancel()  # a final supersedes any hypothesis
                        # Back-pressure: while COMMITS_WAITING commits wait, reading waits (and
                        # TCP holds the client back); a committer stuck that long (its answers
                        # unread) ends the session with an error.
                        with trio.move_on_after(limits.idle_seconds) as stuck:
                            await commits_send.send(action)
                        if stuck.cancelled_caught:
                            await send({"type": "error", "message": f"{COMMITS_WAITING} commits waited "
                                        f"{limits.idle_seconds:g} s for their turn: read the answers"})
                            closing.set()
                            break
                    elif isinstance(action, Partial) and not partial_scope:
                        await nursery.start(hypothesis, action, session.next_segment)
        if session_deadline.cancelled_caught:
            await send({"type": "error", "message": f"session time limit of {limits.max_session_seconds:g} s reached"})
        # Uncommitted audio is discarded; what was committed still gets its answer.
        for scope in partial_scope:
            scope.cancel()
        commits_send.close()
    await websocket.close(1000)
