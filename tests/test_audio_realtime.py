"""Realtime transcription over a WebSocket (trio-websocket as the client), scripted engines."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url

from turbospark.audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech
from turbospark.audio.realtime import Commit, Partial, Send, Session

from ._support import wait_for


def ws_url(server, query: str = "model=scripted-stt") -> str:  # type: ignore[no-untyped-def]
    return server.url.replace("http://", "ws://") + "/v1/audio/transcriptions/realtime?" + query


def pcm(seconds: float) -> bytes:
    return (np.full(int(seconds * 16000), 1000, np.int16)).astype("<i2").tobytes()


async def test_commit_transcribes_everything_buffered_since_the_last_commit(start_server):
    stt = ScriptedSpeechToText()
    server = await start_server(audio=[stt, ScriptedTextToSpeech()])
    async with open_websocket_url(ws_url(server)) as ws:
        await ws.send_message(json.dumps({"type": "commit"}))
        assert json.loads(await ws.get_message()) == {"type": "error", "message": "nothing to commit"}
        for _ in range(5):
            await ws.send_message(pcm(0.1))
        await ws.send_message(json.dumps({"type": "commit"}))
        first = json.loads(await ws.get_message())
        assert first["type"] == "complete" and first["segment_id"] == 0
        assert first["text"] == "Scripted transcript of 0.50 s of audio." and first["language"] == "en"
        assert first["segments"] == [{"start": 0.0, "end": 0.5, "text": " Scripted transcript of 0.50 s of audio."}]
        await ws.send_message(pcm(0.2))
        await ws.send_message(json.dumps({"type": "reset"}))
        await ws.send_message(pcm(0.25))
        await ws.send_message(json.dumps({"type": "commit"}))
        second = json.loads(await ws.get_message())
        assert second["segment_id"] == 1 and "0.25 s" in second["text"]
        await ws.send_message("hello")
        assert json.loads(await ws.get_message())["message"] == 'send binary PCM frames and {"type":"commit"}'
    assert stt.calls == [8000, 4000]


async def test_f32le_encoding_is_accepted_and_odd_frames_close_the_socket(start_server):
    server = await start_server(audio=[ScriptedSpeechToText()])
    async with open_websocket_url(ws_url(server, "model=scripted-stt&encoding=f32le")) as ws:
        await ws.send_message(np.zeros(1600, "<f4").tobytes())
        await ws.send_message(json.dumps({"type": "commit"}))
        assert "0.10 s" in json.loads(await ws.get_message())["text"]
        await ws.send_message(b"\0\0\0")
        assert json.loads(await ws.get_message())["message"] == "frame is not whole, finite samples of the chosen encoding"
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def test_frames_over_the_limit_are_refused_by_the_protocol(start_server):
    server = await start_server(audio=[ScriptedSpeechToText()], max_audio_frame_bytes=4096)
    async with open_websocket_url(ws_url(server)) as ws:
        await ws.send_message(b"\0" * 8192)
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1009


async def test_idle_sessions_are_closed(start_server):
    server = await start_server(audio=[ScriptedSpeechToText()], realtime_idle_seconds=0.3)
    async with open_websocket_url(ws_url(server)) as ws:
        assert json.loads(await ws.get_message()) == {"type": "error", "message": "idle timeout"}
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def test_handshake_is_authenticated_and_validated(start_server):
    server = await start_server(audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()], api_key="secret")
    key = [("authorization", "Bearer secret")]
    cases = [
        ("model=scripted-stt", [], 401),
        ("model=scripted-stt", [("x-api-key", "wrong")], 401),
        ("model=nope", key, 404),
        ("", key, 400),
        ("model=scripted-stt&encoding=mp3", key, 400),
        ("model=scripted-stt&colour=red", key, 400),
        ("model=scripted-tts", key, 400),
        ("model=scripted-stt", [*key, ("origin", "https://evil.example")], 403),
    ]
    for query, headers, status in cases:
        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(ws_url(server, query), extra_headers=headers):
                pass
        assert rejected.value.status_code == status, query
    async with open_websocket_url(ws_url(server), extra_headers=[*key, ("origin", "http://localhost:3000")]) as ws:
        await ws.send_message(json.dumps({"type": "reset"}))


async def test_a_client_that_hangs_up_cancels_its_transcription_at_once(start_server, client):
    stt = ScriptedSpeechToText(step_delay=0.05)
    server = await start_server(audio=[stt])
    async with open_websocket_url(ws_url(server)) as ws:
        await ws.send_message(pcm(20.0)[: 1 << 20])  # ~32 s would be 1 MiB+; this is under it
        await ws.send_message(json.dumps({"type": "commit"}))
        await wait_for(lambda: stt.steps > 2)
    await trio.sleep(0.3)
    steps = stt.steps
    await trio.sleep(0.3)
    assert stt.steps == steps < 100
    text = (await client.get(f"{server.url}/metrics")).text
    assert 'turbospark_audio_cancellations_total{phase="running"} 1.0' in text
    assert "turbospark_audio_in_flight 0.0" in text
    assert 'turbospark_audio_requests_total{endpoint="realtime",status="101"} 1.0' in text


def test_voice_activity_commits_at_pauses_and_asks_for_partials():
    loud = lambda frame: np.frombuffer(frame, "<i2").any()  # noqa: E731
    session = Session("s16le", vad=True, is_speech=loud)
    speech, silence = pcm(0.1), bytes(3200)
    actions = []
    for _ in range(15):  # 1.5 s of speech
        actions += session.binary(speech)
    assert [type(a) for a in actions] == [Partial, Partial]  # every half second of speech
    # each covers the session's audio up to the frame that asked for it (the segment began with it)
    assert [a.audio_end_ms for a in actions] == [600, 1200] == [len(a.audio) * 1000 // 16000 for a in actions]
    for _ in range(7):  # 0.7 s of silence: a pause
        actions += session.binary(silence)
    commits = [a for a in actions if isinstance(a, Commit)]
    assert len(commits) == 1 and commits[0].auto and commits[0].segment_id == 0
    assert 1.5 <= len(commits[0].audio) / 16000 <= 2.2
    for _ in range(50):  # silence alone never commits, and is not kept
        assert session.binary(silence) == []
    assert session.buffered <= 0.6 * 16000
    assert session.text('{"type":"session","vad":false}') == [Send({"type": "session", "vad": False})]


async def test_an_open_session_holds_its_model_loaded(start_server):
    from turbospark.actors.lifecycle import Loadable

    lazy = Loadable(id="lazy-stt", make=lambda: ScriptedSpeechToText(model_id="lazy-stt"),
                    capabilities=frozenset({"speech_to_text"}), context_window=0, size=10,
                    kind="speech-to-text")
    server = await start_server(library=[lazy], keep_alive=0.0)  # idle on-demand models go at once
    async with open_websocket_url(ws_url(server, "model=lazy-stt")) as ws:
        (held,) = [m for m in await server.system.running() if m.entry.id == "lazy-stt"]
        assert held.requests == 1  # the session's lease
        await server.system.unload("lazy-stt")  # asked to unload: it waits for the session
        await ws.send_message(pcm(0.1))
        await ws.send_message(json.dumps({"type": "commit"}))
        assert "0.10 s" in json.loads(await ws.get_message())["text"]
        assert [m.entry.id for m in await server.system.running()].count("lazy-stt") == 1
    # the socket closed: the lease went back and the model unloads
    async def gone() -> None:
        while "lazy-stt" in [m.entry.id for m in await server.system.running()]:
            await trio.sleep(0.02)
    with trio.fail_after(10):
        await gone()


async def test_commits_faster_than_transcription_are_all_answered_in_order(start_server):
    """300 short frames, each followed by a commit, sent as fast as the socket takes them: the
    session takes commits as fast as it transcribes them (reading stops while 64 wait, which
    holds the client back), answers every one in order, and closes cleanly."""
    stt = ScriptedSpeechToText(step_delay=0.002)
    server = await start_server(audio=[stt])
    count = 300
    got: list[dict] = []
    async with open_websocket_url(ws_url(server)) as ws:

        async def sender() -> None:
            for _ in range(count):
                await ws.send_message(pcm(0.05))
                await ws.send_message(json.dumps({"type": "commit"}))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                while len(got) < count:
                    got.append(json.loads(await ws.get_message()))
    assert [m["type"] for m in got] == ["complete"] * count
    assert [m["segment_id"] for m in got] == list(range(count))
    assert len(stt.calls) == count
