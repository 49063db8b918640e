"""Real audio engines behind the server: Whisper tiny.en on MLX and the Piper joe voice, on a few
seconds of speech."""

from __future__ import annotations

import difflib
import json
import re

import numpy as np
import pytest
import trio
from trio_websocket import open_websocket_url

from turbospark.audio import wav
from turbospark.audio.engines import AudioSpec
from turbospark.config import Settings
from turbospark.server import serve

from .realmodels import piper_store, whisper_store

pytestmark = pytest.mark.mlx
TEXT = "The quick brown fox jumps over the lazy dog."


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


def heard_as(text: str, meant: str) -> bool:
    """Whisper tiny heard ``meant`` in ``text``, letter for letter but for a slip: Piper adds
    random noise to its voice on every call, and now and then "quick" comes back "quit"."""
    return difflib.SequenceMatcher(None, "".join(words(text)), "".join(words(meant))).ratio() >= 0.85


@pytest.fixture
async def audio_server(nursery: trio.Nursery):
    pytest.importorskip("mlx_whisper")
    pytest.importorskip("piper")
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.audio.whisper import WhisperSpeechToText

    stt, tts = whisper_store(), piper_store()
    specs = [
        AudioSpec(stt.name, "speech_to_text", lambda: WhisperSpeechToText(stt.path, model_id=stt.name)),
        AudioSpec(tts.name, "text_to_speech", lambda: PiperTextToSpeech(tts.path, model_id=tts.name)),
    ]
    server = await nursery.start(serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, models=("scripted",)), specs)
    yield server
    server.stop.set()


async def test_speech_round_trips_through_the_openai_sdk(audio_server):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{audio_server.url}/v1", api_key="unused")
    speech = await client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav")
    data = speech.read()
    samples, rate = wav.read(data)
    assert rate == 22050 and 1.5 < len(samples) / rate < 6
    result = await client.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data))
    assert heard_as(result.text, TEXT), result.text
    verbose = await client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("speech.wav", data), response_format="verbose_json"
    )
    assert verbose.language == "en" and verbose.segments and verbose.segments[0].start == 0.0
    for fmt, prefix in (("text", ""), ("srt", "1\n00:00:00,000 --> "), ("vtt", "WEBVTT\n\n00:00:00.000 --> ")):
        body = await client.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data), response_format=fmt)
        assert body.startswith(prefix) and words(TEXT)[-1] in words(body)


async def test_realtime_with_voice_activity_sends_partials_and_a_final(audio_server):
    async with trio.open_nursery():
        import httpx

        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{audio_server.url}/v1/audio/speech",
                                json={"model": "tts-1", "input": TEXT + " " + TEXT, "response_format": "wav"})  # fmt: skip
    audio = wav.decode(r.content)
    audio = np.concatenate([audio, np.zeros(16000, np.float32)])  # a pause at the end
    frames = [wav.to_s16(audio[i : i + 1600]) for i in range(0, len(audio), 1600)]
    url = audio_server.url.replace("http://", "ws://") + "/v1/audio/transcriptions/realtime?model=whisper-tiny.en&vad=true"
    received: list[tuple[float, dict]] = []
    async with open_websocket_url(url) as ws:
        async def listen() -> None:
            while True:
                message = json.loads(await ws.get_message())
                received.append((trio.current_time(), message))
                if message["type"] in ("complete", "error"):
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            start = trio.current_time()
            for i, frame in enumerate(frames):  # in real time: 100 ms a frame
                await ws.send_message(frame)
                await trio.sleep_until(start + (i + 1) * 0.1)
            last_frame = trio.current_time()
    kinds = [m["type"] for _, m in received]
    assert kinds[-1] == "complete", received
    partials = [t for t, m in received if m["type"] == "partial"]
    assert partials and partials[0] < last_frame, [(round(t - last_frame, 2), m) for t, m in received]
    ends = [m["audio_end_ms"] for _, m in received if m["type"] == "partial"]
    assert ends == sorted(ends) and all(  # each covers audio already sent, up to where it says
        m["audio_end_ms"] <= (t - start) * 1000 + 100 for t, m in received if m["type"] == "partial")
    final = received[-1][1]
    assert final["auto"] is True and final["segment_id"] == 0
    assert heard_as(" ".join(words(final["text"])[:4]), " ".join(words(TEXT)[:4])), final["text"]
    # the pause ended the segment (``auto``), not the socket: the client never closed it
