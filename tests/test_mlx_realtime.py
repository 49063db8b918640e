"""OpenAI's Realtime API on the real engines: a question spoken by the Piper voice, heard by server
VAD, transcribed by Whisper, answered by SmolLM2 in the batch and spoken back by Piper, whose
answer audio, transcribed again, says what its transcript says; speech over the answer ends it."""

from __future__ import annotations

import base64
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
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from .realmodels import piper_store, smollm2_store, whisper_store
from .test_mlx_audio import heard_as
from .test_realtime_api import Client

pytestmark = pytest.mark.mlx
QUESTION = "What is the capital of France?"


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


@pytest.fixture
async def voice_server(nursery: trio.Nursery):
    pytest.importorskip("mlx_whisper")
    pytest.importorskip("piper")
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.audio.whisper import WhisperSpeechToText
    from turbospark.model.mlx_backend import MlxBackend

    chat, stt, tts = smollm2_store(), whisper_store(), piper_store()
    specs = [
        BackendSpec(chat.name, lambda: MlxBackend(chat.path, model_id=chat.name)),
        AudioSpec(stt.name, "speech_to_text", lambda: WhisperSpeechToText(stt.path, model_id=stt.name)),
        AudioSpec(tts.name, "text_to_speech", lambda: PiperTextToSpeech(tts.path, model_id=tts.name)),
    ]
    server = await nursery.start(serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), specs)
    yield server
    server.stop.set()


async def _spoken(server, text: str) -> str:
    """``text`` as the voice says it, as ``audio/pcm`` (24 kHz) in base64."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(server.url + "/v1/audio/speech", json={"model": "tts-1", "input": text,
                                                                  "voice": "alloy", "response_format": "wav"})
    samples, rate = wav.read(r.content)
    at24k = np.interp(np.arange(0, len(samples), rate / 24000), np.arange(len(samples)), samples)
    return base64.b64encode(np.clip(at24k * 32768, -32768, 32767).astype("<i2").tobytes()).decode()


def _silence(seconds: float) -> str:
    return base64.b64encode(np.zeros(int(seconds * 24000), "<i2").tobytes()).decode()


async def _transcribe(server, pcm24k: bytes) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                            files={"file": ("answer.wav", wav.encode(pcm24k, 24000))})
    return r.json()["text"]


async def test_a_spoken_question_gets_a_spoken_answer_and_speech_over_it_ends_it(voice_server) -> None:
    question = await _spoken(voice_server, QUESTION)
    url = voice_server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    async with open_websocket_url(url, subprotocols=["realtime"], max_message_size=1 << 26) as ws:
        c = Client(ws)
        await c.recv()  # session.created: server VAD, audio out
        await c.send("input_audio_buffer.append", audio=_silence(0.3))
        await c.send("input_audio_buffer.append", audio=question)
        await c.send("input_audio_buffer.append", audio=_silence(1.0))
        events = await c.until("response.done")
        kinds = [e["type"] for e in events]
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped")
        [heard] = [e["transcript"] for e in events
                   if e["type"] == "conversation.item.input_audio_transcription.completed"]
        assert heard_as(heard, QUESTION), heard
        done = events[-1]["response"]
        assert done["status"] == "completed"
        transcript = done["output"][0]["content"][0]["transcript"]
        assert "paris" in words(transcript)
        audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        again = "".join(words(await _transcribe(voice_server, audio)))
        # Whisper tiny hears the voice nearly letter for letter ("The capital of Francis Paris.")
        assert difflib.SequenceMatcher(None, again, "".join(words(transcript))).ratio() >= 0.85, (again, transcript)

        # a longer answer, and the question spoken again over it
        await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
        await c.until("conversation.item.done")
        await c.send("response.create")
        await c.until("response.output_audio.delta")
        await c.send("input_audio_buffer.append", audio=question)
        events = await c.until("response.done")
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    said = "".join(e["delta"] for e in c.seen if e["type"] == "response.output_audio_transcript.delta"
                   and e["response_id"] == done["id"])
    kept = done["output"][0]["content"][0]["transcript"]
    assert kept and said.startswith(kept) and len(kept) < len(said), (kept, said)
    assert json.dumps(done["usage"])  # the tokens it did decode are counted


async def test_the_openai_sdk_as_a_new_user_writes_it(voice_server) -> None:
    """``client.realtime.connect()``: a spoken question is transcribed and answered in text and
    audio; the question spoken over a long answer ends it as cancelled."""
    import openai

    question = await _spoken(voice_server, QUESTION)

    def talk() -> tuple[str, str, int, str, str]:
        client = openai.OpenAI(base_url=voice_server.url + "/v1", api_key="unused")
        with client.realtime.connect(model="gpt-realtime") as conn:
            for audio in (_silence(0.3), question, _silence(1.0)):
                conn.input_audio_buffer.append(audio=audio)
            heard, audio_bytes = "", 0
            for event in conn:
                if event.type == "conversation.item.input_audio_transcription.completed":
                    heard = event.transcript
                elif event.type == "response.output_audio.delta":
                    audio_bytes += len(base64.b64decode(event.delta))
                elif event.type == "response.done":
                    answer = event.response.output[0].content[0].transcript
                    break
            conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
            conn.response.create()
            for event in conn:
                if event.type == "response.output_audio.delta":
                    conn.input_audio_buffer.append(audio=question)  # speaking over the answer
                    break
            for event in conn:
                if event.type == "response.done":
                    return heard, answer, audio_bytes, event.response.status, event.response.status_details.reason
        raise AssertionError("the connection ended")

    heard, answer, audio_bytes, status, reason = await trio.to_thread.run_sync(talk)
    assert heard_as(heard, QUESTION) and "paris" in words(answer) and audio_bytes > 48_000, (heard, answer)
    assert (status, reason) == ("cancelled", "turn_detected")


async def test_a_transcription_session_hears_what_the_transcription_route_hears(voice_server) -> None:
    """The spoken question, streamed to a ``?intent=transcription`` session in 0.1 s pieces and
    committed, is transcribed by Whisper exactly as the same audio sent as a file."""
    question = base64.b64decode(await _spoken(voice_server, QUESTION))
    url = voice_server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    async with open_websocket_url(url, max_message_size=1 << 26) as ws:
        c = Client(ws)
        assert (await c.recv())["session"]["type"] == "transcription"
        await c.send("session.update", session={"type": "transcription", "audio": {"input": {"turn_detection": None}}})
        await c.until("session.updated")
        for start in range(0, len(question), 4800):
            await c.send("input_audio_buffer.append", audio=base64.b64encode(question[start:start + 4800]).decode())
        await c.send("input_audio_buffer.commit")
        completed = (await c.until("conversation.item.input_audio_transcription.completed"))[-1]
    assert heard_as(completed["transcript"], QUESTION), completed
    assert completed["transcript"] == (await _transcribe(voice_server, question)).strip()
