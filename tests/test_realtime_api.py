"""OpenAI's Realtime API at ``/v1/realtime``: the sans-io pieces directly, then sessions against a
real server with the scripted chat model, speech-to-text and voice.  Every server event is read
back through the openai SDK's own GA event types (``RealtimeServerEvent``), strictly."""

from __future__ import annotations

import base64
import io
import json
import re
import warnings
import wave
from typing import Any

import httpx
import numpy as np
import pydantic
import pytest
import trio
from openai.types.realtime import RealtimeServerEvent
from trio_websocket import open_websocket_url

from turbospark.audio import wav
from turbospark.audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech
from turbospark.audio.realtime_api import (
    InputBuffer,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    _alaw_decode,
    _alaw_encode,
    _ulaw_decode,
    _ulaw_encode,
    decode_audio,
    encode_audio,
)
from turbospark.audio.realtime_state import Conversation, SessionConfig
from turbospark.audio.realtime_text import Agreement, Sentences, Spoken
from turbospark.errors import RequestInvalid
from turbospark.model.scripted import ScriptedBackend

_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)

with warnings.catch_warnings():  # the reference codec: in the standard library up to Python 3.12
    warnings.simplefilter("ignore", DeprecationWarning)
    audioop = pytest.importorskip("audioop")

# --- sans-io ------------------------------------------------------------------------------------


def test_g711_equals_the_standard_codec_on_every_sample() -> None:
    every = np.arange(-32768, 32768).astype("<i2")
    x = every / 32768.0
    assert _ulaw_encode(x).tobytes() == audioop.lin2ulaw(every.tobytes(), 2)
    assert _alaw_encode(x).tobytes() == audioop.lin2alaw(every.tobytes(), 2)
    codes = bytes(range(256))
    assert np.array_equal(_ulaw_decode(np.frombuffer(codes, np.uint8)) * 32768,
                          np.frombuffer(audioop.ulaw2lin(codes, 2), "<i2"))
    assert np.array_equal(_alaw_decode(np.frombuffer(codes, np.uint8)) * 32768,
                          np.frombuffer(audioop.alaw2lin(codes, 2), "<i2"))


def test_audio_formats_in_and_out() -> None:
    second = (np.sin(np.arange(24000) / 10) * 8000).astype("<i2").tobytes()
    pcm, rate = decode_audio(base64.b64encode(second).decode(), "audio/pcm")
    assert pcm.dtype == np.float32 and (pcm.size, rate) == (24000, 24000)
    assert len(encode_audio(second, 24000, "audio/pcm")) == 48000
    assert len(encode_audio(second, 24000, "audio/pcmu")) == 8000  # G.711: 8 kHz, a byte a sample
    ulaw, rate = decode_audio(base64.b64encode(b"\xff" * 800).decode(), "audio/pcmu")
    assert (ulaw.size, rate) == (800, 8000)


def test_a_commit_reads_as_the_same_audio_sent_as_a_file() -> None:
    """Chunks appended at any rate are resampled whole at commit, as the transcription route
    resamples a WAV file: 16 kHz, the same samples."""
    second = (np.sin(np.arange(48000) / 7) * 0.3).astype(np.float32)
    buffer = InputBuffer()
    for start in range(0, 48000, 4800):  # 0.2 s at a time, as a client streams it
        buffer.append(second[start:start + 4800], 24000)
    assert buffer.seconds == pytest.approx(2.0)
    assert np.array_equal(buffer.take(), wav.resample(second, 24000))
    assert buffer.seconds == 0 and buffer.take().size == 0
    buffer.append(np.ones(8000, np.float32), 8000)  # the format changed: each run resampled whole
    buffer.append(np.ones(24000, np.float32), 24000)
    assert buffer.take().size == 32000


def test_silence_before_speech_is_let_go() -> None:
    buffer = InputBuffer()
    for _ in range(50):
        buffer.append(np.zeros(2400, np.float32), 24000)  # 0.1 s
        buffer.trim(0.33)
    assert buffer.seconds == pytest.approx(0.33, abs=1 / 24000)
    buffer.append(np.ones(24000, np.float32), 24000)
    buffer.trim(2.0)
    assert buffer.seconds == pytest.approx(1.33, abs=1 / 24000)  # nothing to let go yet
    taken = buffer.take()
    assert taken.size == pytest.approx(1.33 * 16000, abs=2) and taken[-100:].mean() == pytest.approx(1, abs=0.01)
    with pytest.raises(RequestInvalid, match="odd number"):
        decode_audio(base64.b64encode(b"\0\0\0").decode(), "audio/pcm")
    with pytest.raises(RequestInvalid, match="base64"):
        decode_audio("not base64!", "audio/pcm")


def test_session_update_checks_and_merges() -> None:
    config = SessionConfig.new("realtime", model="m", voice="v", stt_model="s", session_id="sess_1")
    assert config.turn_detection is not None and config.data["output_modalities"] == ["audio"]
    config.update({"type": "realtime", "instructions": "Be brief.", "tracing": "auto",
                   "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}}})
    assert config.turn_detection is None and config.voice == "alloy" and config.data["instructions"] == "Be brief."
    assert config.data["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}  # kept
    for bad, match in [({"modalities": ["text"]}, "unknown field"), ({"temperature": "hot"}, "number"),
                       ({"type": "transcription"}, "cannot change"), ({"max_output_tokens": 0}, "max_output_tokens"),
                       ({"tool_choice": "sometimes"}, "tool_choice"),
                       ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "24000")]:
        with pytest.raises(RequestInvalid, match=match):
            config.update(bad)
    assert config.data["instructions"] == "Be brief."  # a refused update changes nothing


def test_conversation_items_become_chat_messages() -> None:
    c = Conversation()
    user, prev = c.create({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
    assert prev is None and user["object"] == "realtime.item" and user["status"] == "completed"
    c.create({"type": "function_call", "name": "f", "call_id": "c1", "arguments": '{"a": 1}'})
    c.create({"type": "function_call", "name": "g", "call_id": "c2", "arguments": "{}"})
    c.create({"type": "function_call_output", "call_id": "c1", "output": "one"})
    _, prev = c.create({"type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]}, "root")
    assert prev is None and c.items[0]["role"] == "system"
    messages = c.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [call["id"] for call in messages[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    c.delete(user["id"])
    with pytest.raises(RequestInvalid, match="not found"):
        c.get(user["id"])
    for bad, match in [({"type": "message", "role": "robot", "content": []}, "role"),
                       ({"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]}, "type"),
                       ({"type": "function_call", "name": "f"}, "call_id"), ({"type": "picture"}, "item.type")]:
        with pytest.raises(RequestInvalid, match=match):
            c.create(bad)


def test_sentences_are_cut_where_speech_can_start() -> None:
    s = Sentences()
    pieces = "Hello there. How are you? I am 3.5 years old! Fine"
    out = [sentence for piece in re.findall(r".{1,3}", pieces, re.S) for sentence in s.feed(piece)]
    assert out == ["Hello there.", " How are you?", " I am 3.5 years old!"]
    assert s.flush() == [" Fine"] and s.flush() == []


def test_the_first_phrase_goes_to_the_voice_before_its_sentence_ends() -> None:
    s = Sentences()
    text = "Well, the capital of France, as you know, is Paris, a city of 2,100,000 people. It is old, too."
    out = [sentence for piece in re.findall(r".{1,3}", text, re.S) for sentence in s.feed(piece)]
    # "Well," has too few words to be said alone; the first phrase with three does; then sentences
    assert out == ["Well, the capital of France,", " as you know, is Paris, a city of 2,100,000 people."]
    assert s.flush() == [" It is old, too."]


def test_hypotheses_give_the_words_two_in_a_row_agree_on_and_the_final_gives_the_rest() -> None:
    a = Agreement()
    assert a.hypothesis("What is") == ""  # one hypothesis: nothing agreed yet
    assert a.hypothesis("What is the cap") == "What is"
    assert a.hypothesis("What is the capital of") == " the"  # "cap" and "capital" disagree
    assert a.hypothesis("What was the capital") == ""  # it contradicts what was given: nothing
    assert a.final("What is the capital of France?") == " capital of France?"
    assert a.given == "What is the capital of France?".split()
    b = Agreement()
    b.hypothesis("Hello there")
    assert b.hypothesis("Hello there, friend") == "Hello there,"  # as the later one writes them
    assert b.final("Hi there.") == ""  # the transcript contradicts them: its completed event stands
    c = Agreement()  # a hypothesis cut mid-sentence ends it, and may start it in lower case
    c.hypothesis("the quick brown fox.")
    assert c.hypothesis("The quick brown fox jumps over.") == "The quick brown fox"
    assert c.final("The quick brown fox jumps over the dog.") == " jumps over the dog."
    d = Agreement()  # a hypothesis whose audio ends in a pause gives every word at once
    assert d.hypothesis("What is the", settled=True) == "What is the"
    assert d.prefix == "What is the"  # the next hypothesis decodes from them
    assert d.hypothesis("What is the capital", settled=False) == ""
    assert d.hypothesis("What is a capital", settled=True) == ""  # contradicting: nothing
    assert d.hypothesis("What is the capital of France?", settled=True) == " capital of France?"


def test_spoken_keeps_the_text_whose_audio_went_out() -> None:
    spoken = Spoken()
    spoken.begin("One two three four. ")
    spoken.sent(1000)
    spoken.end()
    spoken.begin("Five six seven eight. ")
    spoken.sent(500)  # some of it went out, then the answer was cancelled
    assert spoken.heard() == "One two three four. Five six seven eight."
    assert spoken.heard(1250) == "One two three four. Five six"  # the client played only this far
    assert spoken.heard(500) == "One two"
    assert spoken.heard(1000) == "One two three four."
    assert spoken.heard(0) == ""


def test_turn_detection_finds_speech_and_its_end() -> None:
    loud = lambda frame: np.abs(np.frombuffer(frame, "<i2")).mean() > 100  # noqa: E731
    detector = TurnDetector(loud, silence_duration_ms=300, prefix_padding_ms=100)
    silence, speech = np.zeros(16000, np.float32), np.full(16000, 0.1, np.float32)
    assert detector.feed(silence) == []
    assert detector.feed(speech[:8000]) == [SpeechStarted(890)]  # the first voiced frame (990 ms) less 100 ms
    assert detector.feed(speech[:8000]) == []
    assert detector.feed(silence) == [SpeechPaused(2010), SpeechStopped(2010)]  # after 200 ms, then 300 ms


def test_turn_detection_says_where_the_speaker_pauses_and_goes_on() -> None:
    loud = lambda frame: np.abs(np.frombuffer(frame, "<i2")).mean() > 100  # noqa: E731
    detector = TurnDetector(loud, silence_duration_ms=300, prefix_padding_ms=100, early_ms=150)
    silence, speech = np.zeros(16000, np.float32), np.full(16000, 0.1, np.float32)
    assert detector.feed(silence[:8000]) == []
    assert detector.feed(speech[:4800]) == [SpeechStarted(380)]
    assert detector.feed(silence[:1920]) == []  # 120 ms: not yet a pause
    assert detector.feed(silence[:1920]) == [SpeechPaused(810)]  # its last voiced frame ended at 810 ms
    assert detector.feed(speech[:960]) == [SpeechResumed()]  # the same turn goes on
    assert detector.feed(silence) == [SpeechPaused(1110), SpeechStopped(1110)]
    assert detector.feed(speech[:4800]) == [SpeechStarted(2000)]
    assert detector.feed(silence[:3200]) == [SpeechPaused(2400)]
    detector.reset()  # cleared: no pause is left over
    assert not detector.paused and detector.feed(speech[:960]) == []
    assert TurnDetector(loud, silence_duration_ms=150, early_ms=200).feed(np.concatenate(
        [speech[:4800], silence])) == [SpeechStarted(0), SpeechStopped(300)]  # no pause before so short a turn


# --- sessions against a server ------------------------------------------------------------------


class Client:
    """A Realtime client over trio-websocket: every event received is checked against the SDK's
    GA types and kept in ``seen``."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send_message(json.dumps({"type": kind, **fields}))

    async def recv(self) -> dict[str, Any]:
        with trio.fail_after(20):
            raw = await self.ws.get_message()
        _EVENT.validate_json(raw, strict=False)
        message = json.loads(raw)
        self.seen.append(message)
        return message

    async def say(self, text: str) -> list[dict[str, Any]]:
        """A user text item, created: its added and done events."""
        await self.send("conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return await self.until("conversation.item.done")

    async def until(self, kind: str) -> list[dict[str, Any]]:
        got = []
        while True:
            message = await self.recv()
            got.append(message)
            if message["type"] == kind:
                return got


def _url(server: Any, query: str = "model=gpt-realtime") -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime?" + query


async def _session(ws: Any, **session: Any) -> Client:
    c = Client(ws)
    created = await c.recv()
    assert created["type"] == "session.created"
    if session:
        await c.send("session.update", session={"type": created["session"]["type"], **session})
        assert (await c.recv())["type"] == "session.updated"
    return c


def _speech(seconds: float) -> str:
    """``audio/pcm`` (24 kHz, 16-bit) of a loud noise: speech to the VAD."""
    noise = np.random.default_rng(0).normal(0, 6000, int(seconds * 24000))
    return base64.b64encode(np.clip(noise, -32768, 32767).astype("<i2").tobytes()).decode()


def _silence(seconds: float) -> str:
    return base64.b64encode(np.zeros(int(seconds * 24000), "<i2").tobytes()).decode()


SCRIPT = "Hello there. This is a scripted answer. It has three sentences."


async def _audio_server(start_server: Any, **backend: Any) -> Any:
    return await start_server(backends=[ScriptedBackend(script=backend.pop("script", SCRIPT), **backend)],
                              audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])


async def test_a_text_item_gets_a_spoken_answer(start_server) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server), subprotocols=["realtime"]) as ws:
        c = await _session(ws, instructions="Be brief.", audio={"input": {"turn_detection": None}})
        assert [e["type"] for e in await c.say("Hi")] == ["conversation.item.added", "conversation.item.done"]
        await c.send("response.create")
        events = await c.until("response.done")
    kinds = [e["type"] for e in events]
    assert kinds[:6] == ["response.created", "rate_limits.updated", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added",
                         "response.output_audio_transcript.delta"]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert transcript == SCRIPT
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    # the scripted voice speaks 50 ms a character, each sentence alone; 24 kHz, 16-bit
    sentences = ["Hello there.", "This is a scripted answer.", "It has three sentences."]
    assert len(audio) == sum(round(len(s) * 0.05 * 24000) * 2 for s in sentences)
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"] == [
        {"type": "output_audio", "transcript": SCRIPT}]
    assert done["usage"]["output_tokens"] > 0 and done["usage"]["input_tokens"] > 0


async def test_text_only_answers_and_a_forced_tool_call_round_trip(start_server) -> None:
    backend = ScriptedBackend(script=SCRIPT)
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, output_modalities=["text"], tools=tools, tool_choice="required")
        await c.send("conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]})
        await c.until("conversation.item.done")
        await c.send("response.create")
        events = await c.until("response.done")
        kinds = [e["type"] for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.output_audio.delta" not in kinds
        [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert args_done["name"] == "get_weather" and set(json.loads(args_done["arguments"])) == {"city"}
        call = events[-1]["response"]["output"][0]
        assert call["type"] == "function_call" and call["status"] == "completed"
        await c.send("conversation.item.create", item={
            "type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'})
        await c.until("conversation.item.done")
        await c.send("response.create", response={"tool_choice": "none"})
        events = await c.until("response.done")
    # the model read the call and its output (the last sequence the scripted model held)
    read = backend.tokenizer.decode(backend._seen[-1])
    assert "get_weather" in read and "Oslo" in read and '{"sky": "clear"}' in read, read
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == SCRIPT and events[-1]["response"]["output"][0]["content"] == [
        {"type": "output_text", "text": SCRIPT}]


async def test_push_to_talk_transcribes_then_answers(start_server) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, audio={"input": {"turn_detection": None}})
        await c.send("input_audio_buffer.commit")
        error = (await c.recv())["error"]
        assert error["code"] == "input_audio_buffer_commit_empty"
        for _ in range(3):
            await c.send("input_audio_buffer.append", audio=_silence(0.5))
        await c.send("input_audio_buffer.commit")
        events = await c.until("conversation.item.done")
        assert [e["type"] for e in events] == [
            "input_audio_buffer.committed", "conversation.item.added",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
        assert events[3]["transcript"] == "Scripted transcript of 1.50 s of audio."
        assert events[-1]["item"]["content"] == [
            {"type": "input_audio", "transcript": "Scripted transcript of 1.50 s of audio."}]
        await c.send("response.create", response={"output_modalities": ["text"]})
        assert (await c.until("response.done"))[-1]["response"]["status"] == "completed"


async def test_speech_starts_a_turn_and_speech_over_the_answer_cancels_it(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.02)  # endless text, paced
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, audio={"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}})
        for _ in range(30):  # a silent room: let go as it ages, never a turn's
            await c.send("input_audio_buffer.append", audio=_silence(0.1))
        await c.send("input_audio_buffer.append", audio=_speech(0.6))
        await c.send("input_audio_buffer.append", audio=_silence(0.5))
        events = await c.until("response.output_audio.delta")  # the turn ended, the answer is spoken
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"]
        assert "response.created" in kinds
        # the turn holds its 300 ms of padding, the speech and what VAD heard of the pause after it
        [completed] = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
        assert 0.9 <= completed["usage"]["seconds"] <= 1.5, completed
        await c.send("input_audio_buffer.append", audio=_speech(0.6))  # barge-in
        events = await c.until("response.done")
        steps = backend.counters.decode_steps
        await trio.sleep(0.3)
        assert backend.counters.decode_steps - steps <= 1  # nothing decodes for the cancelled answer
    assert "input_audio_buffer.speech_started" in [e["type"] for e in events]
    metrics = (await client.get(server.url + "/metrics")).text
    assert re.search(r'turbospark_cancellations_total\{phase="decode"\} 1', metrics)
    response = events[-1]["response"]
    assert response["status"] == "cancelled" and response["status_details"] == {
        "type": "cancelled", "reason": "turn_detected"}
    said = "".join(e["delta"] for e in c.seen if e["type"] == "response.output_audio_transcript.delta")
    heard = response["output"][0]["content"][0]["transcript"]
    assert heard and said.startswith(heard) and len(heard) < len(said)  # only what was spoken
    assert response["output"][0]["status"] == "incomplete"


async def test_a_turn_is_transcribed_from_the_pause_and_a_pause_the_speaker_breaks_is_let_go(
        start_server, client) -> None:
    stt = ScriptedSpeechToText(step_delay=0.05)  # 0.5 s a second of audio
    server = await start_server(backends=[ScriptedBackend(script=SCRIPT)], audio=[stt, ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, output_modalities=["text"],
                           audio={"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}})
        async def pause(seconds: float) -> None:  # in 100 ms frames, as a microphone sends them
            for _ in range(round(seconds * 10)):
                await c.send("input_audio_buffer.append", audio=_silence(0.1))

        await c.send("input_audio_buffer.append", audio=_speech(0.6))
        await pause(0.3)  # a pause: its transcription begins
        with trio.fail_after(5):
            while not stt.calls:
                await trio.sleep(0.01)
        await c.send("input_audio_buffer.append", audio=_speech(0.6))  # the speaker goes on
        await trio.sleep(0.15)
        steps = stt.steps
        await trio.sleep(0.3)
        assert stt.steps == steps < stt.calls[0] // 1600  # that transcription stopped, unfinished
        await pause(1.0)
        events = await c.until("response.done")
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index(
        "conversation.item.input_audio_transcription.completed") < kinds.index("response.created")
    assert len(stt.calls) == 2  # the turn's transcription began at its last pause, and the commit took it
    [completed] = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    # the words up to the pause (the scripted model says how much audio it read); the item's audio
    # is the whole turn, its silence included
    assert completed["transcript"] == f"Scripted transcript of {stt.calls[1] / 16000:.2f} s of audio."
    assert 0.6 + 0.3 + 0.6 + 0.2 <= stt.calls[1] / 16000 <= 0.6 + 0.3 + 0.6 + 0.5  # to the pause's 200-500 ms
    assert completed["usage"]["seconds"] >= stt.calls[1] / 16000 + 0.2  # VAD waited on after it
    metrics = (await client.get(server.url + "/metrics")).text
    assert re.search(r'turbospark_audio_work_total\{endpoint="realtime",outcome="cancelled"\} 1', metrics)
    assert re.search(r'turbospark_audio_work_total\{endpoint="realtime",outcome="done"\} 1', metrics)


async def test_a_commit_of_the_clients_own_during_a_pause_transcribes_the_whole_turn(start_server, client) -> None:
    stt = ScriptedSpeechToText(step_delay=0.05)
    server = await start_server(backends=[ScriptedBackend(script=SCRIPT)], audio=[stt, ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, output_modalities=["text"],
                           audio={"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}})
        await c.send("input_audio_buffer.append", audio=_speech(0.6))
        for _ in range(3):
            await c.send("input_audio_buffer.append", audio=_silence(0.1))
        with trio.fail_after(5):
            while not stt.calls:  # the pause's transcription began
                await trio.sleep(0.01)
        await c.send("input_audio_buffer.commit")
        [completed] = [e for e in await c.until("conversation.item.input_audio_transcription.completed")
                       if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(stt.calls) == 2 and stt.calls[1] == round(completed["usage"]["seconds"] * 16000)
    assert completed["transcript"] == f"Scripted transcript of {stt.calls[1] / 16000:.2f} s of audio."
    metrics = (await client.get(server.url + "/metrics")).text
    assert re.search(r'turbospark_audio_work_total\{endpoint="realtime",outcome="cancelled"\} 1', metrics)


async def test_response_cancel_stops_the_decode_within_a_step(start_server, client: httpx.AsyncClient) -> None:
    backend = ScriptedBackend(token_delay=0.05)
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, output_modalities=["text"])
        await c.say("Talk.")
        await c.send("response.create")
        await c.until("response.output_text.delta")
        await c.send("response.cancel")
        events = await c.until("response.done")
        assert events[-1]["response"]["status_details"]["reason"] == "client_cancelled"
        steps = backend.counters.decode_steps
        await trio.sleep(0.3)
        assert backend.counters.decode_steps - steps <= 1  # nothing decodes for the cancelled answer
        await c.send("response.cancel")
        assert (await c.recv())["error"]["code"] == "response_cancel_not_active"
    metrics = (await client.get(server.url + "/metrics")).text
    assert re.search(r'turbospark_cancellations_total\{phase="decode"\} 1', metrics)


async def test_bad_events_are_error_events_and_the_session_goes_on(start_server) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws)
        await c.send("session.update", session={"type": "realtime", "modalities": ["text"]})
        assert "unknown field" in (await c.recv())["error"]["message"]
        await c.send("no.such.event", event_id="evt_1")
        error = (await c.recv())["error"]
        assert error["code"] == "invalid_value" and error["event_id"] == "evt_1"
        await ws.send_message("{not json")
        assert (await c.recv())["type"] == "error"
        await c.send("conversation.item.retrieve", item_id="item_missing")
        assert (await c.recv())["error"]["code"] == "item_not_found"
        await c.send("conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        item = (await c.until("conversation.item.done"))[-1]["item"]
        await c.send("conversation.item.retrieve", item_id=item["id"])
        assert (await c.recv())["item"] == item


async def test_a_transcription_session_gives_what_the_transcription_route_gives(start_server, client) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server, "intent=transcription")) as ws:
        c = Client(ws)
        created = await c.recv()
        assert created["session"]["type"] == "transcription"
        await c.send("session.update", session={"type": "transcription", "audio": {"input": {"turn_detection": None}}})
        await c.recv()
        await c.send("input_audio_buffer.append", audio=_silence(1.25))
        await c.send("input_audio_buffer.commit")
        completed = (await c.until("conversation.item.input_audio_transcription.completed"))[-1]
        await c.send("response.create")
        assert (await c.recv())["error"]["code"] == "invalid_value"  # no responses here
    pcm16k = np.zeros(20000, "<i2").tobytes()  # the same 1.25 s, through the HTTP route
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm16k)
    wav = await client.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", buf.getvalue())},
                            data={"model": "whisper-1"})
    assert completed["transcript"] == wav.json()["text"]


async def test_a_transcription_session_gives_words_while_the_speaker_talks(start_server) -> None:
    stt = ScriptedSpeechToText(step_delay=0.005)
    server = await start_server(backends=[ScriptedBackend(script=SCRIPT)], audio=[stt, ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server, "intent=transcription")) as ws:
        c = Client(ws)
        await c.recv()
        await c.send("session.update", session={"type": "transcription", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
        await c.recv()
        for _ in range(20):  # two seconds of speech, as a microphone sends it
            await c.send("input_audio_buffer.append", audio=_speech(0.1))
            await trio.sleep(0.05)
        for _ in range(10):
            await c.send("input_audio_buffer.append", audio=_silence(0.1))
        events = await c.until("conversation.item.input_audio_transcription.completed")
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    # the words the hypotheses agree on ("Scripted transcript of" a growing duration) come before
    # the turn is committed; the rest of its transcript after
    assert kinds.index("conversation.item.input_audio_transcription.delta") < kinds.index("input_audio_buffer.committed")
    assert deltas[0]["delta"] == "Scripted transcript of"
    # the pause's transcription gives every word, decoded from those already given; the turn's
    # transcript is its (no transcription after the commit)
    assert len(deltas) == 2 and deltas[1]["delta"].startswith(" 2.")
    assert stt.prefixes[0] == "" and stt.prefixes[-1] == "Scripted transcript of"
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    assert {d["item_id"] for d in deltas} == {started["item_id"]}
    assert "".join(d["delta"] for d in deltas) == events[-1]["transcript"]
    assert len(stt.calls) >= 3  # hypotheses while the speaker talks, then the pause's


async def test_the_openai_sdk_talks_to_it(start_server) -> None:
    """``client.realtime.connect()`` as a user writes it (the SDK's own sync client, in a thread)."""
    import openai

    server = await _audio_server(start_server)

    def talk() -> tuple[str, str, int]:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        with client.realtime.connect(model="gpt-realtime") as conn:
            conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                         "audio": {"input": {"turn_detection": None}}})
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "Hi"}]})
            conn.response.create()
            audio = 0
            for ev in conn:
                if ev.type == "response.output_audio.delta":
                    audio += len(base64.b64decode(ev.delta))
                if ev.type == "response.done":
                    return ev.response.status, ev.response.output[0].content[0].transcript, audio
        raise AssertionError("no response.done")

    status, transcript, audio = await trio.to_thread.run_sync(talk)
    assert (status, transcript) == ("completed", SCRIPT) and audio > 0


async def test_the_agents_sdk_realtime_runner_calls_a_tool(start_server) -> None:
    """The OpenAI Agents SDK's ``RealtimeRunner`` (its own session.update, tools, the function
    output sent back), pointed at the server by its ``url``."""
    import asyncio

    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    server = await _audio_server(start_server)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    async def run() -> tuple[list[str], str | None]:
        agent = RealtimeAgent(name="Assistant", instructions="Use the tool.", tools=[get_weather])
        settings = {"model_name": "gpt-realtime", "output_modalities": ["text"], "turn_detection": None,
                    "tool_choice": "required"}
        runner = RealtimeRunner(starting_agent=agent, config={"model_settings": settings})
        url = server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
        session = await runner.run(model_config={"url": url, "api_key": "unused"})
        kinds: list[str] = []
        async with session:
            await session.send_message("What is the weather in Oslo?")
            async for ev in session:
                kinds.append(ev.type)
                if ev.type == "error":
                    return kinds, str(ev.error)
                if ev.type == "tool_end":
                    return kinds, ev.output
        return kinds, None

    kinds, output = await trio.to_thread.run_sync(lambda: asyncio.run(asyncio.wait_for(run(), 60)))
    assert "error" not in kinds and "tool_start" in kinds
    assert output is not None and output.startswith("It is sunny in ")


async def test_truncate_keeps_the_words_the_client_played(start_server) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, audio={"input": {"turn_detection": None}})
        await c.say("Hi")
        await c.send("response.create")
        item = (await c.until("response.done"))[-1]["response"]["output"][0]
        # "Hello there." is 12 characters at 50 ms: 600 ms; the client played 900 ms of the answer
        await c.send("conversation.item.truncate", item_id=item["id"], content_index=0, audio_end_ms=900)
        assert (await c.recv())["type"] == "conversation.item.truncated"
        await c.send("conversation.item.retrieve", item_id=item["id"])
        kept = (await c.recv())["item"]["content"][0]["transcript"]
        assert kept == "Hello there. This"  # and 300 ms of the next sentence's 1.3 s: one of its 5 words
        await c.send("conversation.item.truncate", item_id=item["id"], content_index=0, audio_end_ms=99_000)
        assert "past the item's audio" in (await c.recv())["error"]["message"]


async def test_a_client_that_stops_reading_is_closed_and_its_answer_stopped(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.005)  # an endless answer: far more audio than any buffer
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()],
                                write_timeout=1.0)
    async with open_websocket_url(_url(server), max_message_size=1 << 26) as ws:
        c = await _session(ws)
        await c.say("Talk.")
        await c.send("response.create")

        async def cancelled() -> bool:
            metrics = (await client.get(server.url + "/metrics")).text
            return bool(re.search(r'turbospark_cancellations_total\{phase="decode"\} 1', metrics))

        with trio.fail_after(30):  # the client reads nothing more
            while not await cancelled():
                await trio.sleep(0.2)
    steps = backend.counters.decode_steps
    await trio.sleep(0.3)
    assert backend.counters.decode_steps - steps <= 1


async def test_the_api_key_comes_as_a_header_or_as_openais_browser_subprotocol(start_server) -> None:
    from trio_websocket import ConnectionRejected

    server = await start_server(audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()], api_key="k3y")
    with pytest.raises(ConnectionRejected) as refused:
        async with open_websocket_url(_url(server)):
            pass
    assert refused.value.status_code == 401
    async with open_websocket_url(_url(server), subprotocols=["realtime", "openai-insecure-api-key.k3y"]) as ws:
        assert ws.subprotocol == "realtime" and (await Client(ws).recv())["type"] == "session.created"
    async with open_websocket_url(_url(server), extra_headers=[("Authorization", "Bearer k3y")]) as ws:
        assert (await Client(ws).recv())["type"] == "session.created"


async def test_push_to_talk_then_respond_at_once_reads_the_words(start_server) -> None:
    """commit and response.create back to back (the SDKs' push-to-talk): the answer waits for the
    transcript instead of answering an empty conversation."""
    stt = ScriptedSpeechToText(step_delay=0.05)  # a transcription that takes a while
    server = await start_server(backends=[ScriptedBackend(script=SCRIPT)], audio=[stt, ScriptedTextToSpeech()])
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, output_modalities=["text"], audio={"input": {"turn_detection": None}})
        await c.send("input_audio_buffer.append", audio=_silence(1.0))
        await c.send("input_audio_buffer.commit")
        await c.send("response.create")
        events = await c.until("response.done")
    kinds = [e["type"] for e in events]
    assert kinds.index("conversation.item.input_audio_transcription.completed") < kinds.index("response.output_text.delta")
    assert events[-1]["response"]["status"] == "completed"


async def test_session_updates_are_whole_or_refused_and_keep_a_turn_going(start_server) -> None:
    server = await _audio_server(start_server)
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws)
        for bad in ({"audio": None}, {"audio": {"input": None}}, {"audio": {"output": {"speed": 0.01}}},
                    {"instructions": "x", "audio": {"output": {"voice": 7}}}):
            await c.send("session.update", session={"type": "realtime", **bad})
            assert (await c.recv())["type"] == "error"
        await c.send("session.update", session={"type": "realtime", "id": "sess_echoed", "object": "realtime.session",
                                                "audio": {"output": {"voice": "marin"}}})
        updated = (await c.recv())["session"]
        assert updated["instructions"] == "" and updated["audio"]["output"]["voice"] == "marin"
        await c.send("input_audio_buffer.append", audio=_silence(2.0))
        await c.send("session.update", session={"type": "realtime", "instructions": "Be brief."})
        await c.recv()
        await c.send("input_audio_buffer.append", audio=_speech(0.6))
        started = await c.until("input_audio_buffer.speech_started")
        assert started[-1]["audio_start_ms"] >= 1600  # 2 s in, less the padding: the session's clock
        await c.send("input_audio_buffer.append", audio=_silence(1.0))
        assert (await c.until("response.done"))[-1]["response"]["status"] == "completed"


async def test_truncate_while_the_answer_speaks_then_cancel(start_server) -> None:
    """As the Agents SDK interrupts: truncate to what was played, then response.cancel."""
    server = await _audio_server(start_server, script=None, token_delay=0.02)
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws, audio={"input": {"turn_detection": None}})
        await c.say("Talk.")
        await c.send("response.create")
        delta = (await c.until("response.output_audio.delta"))[-1]
        await c.send("conversation.item.truncate", item_id=delta["item_id"], content_index=0, audio_end_ms=500)
        await c.until("conversation.item.truncated")
        await c.send("response.cancel")
        done = (await c.until("response.done"))[-1]["response"]
    assert done["status"] == "cancelled"
    # "The quick brown fox jumps over the lazy dog." (44 characters, 2.2 s): 500 ms is 2 of its 9 words
    assert done["output"][0]["content"][0]["transcript"] == "The quick"


async def test_sessions_answer_in_the_same_batch_as_http_requests(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.05)
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, "stream": True}
    async with (open_websocket_url(_url(server)) as one, open_websocket_url(_url(server)) as two,
                client.stream("POST", server.url + "/v1/chat/completions", json=body) as http):
        sessions = [await _session(ws, output_modalities=["text"]) for ws in (one, two)]
        for c in sessions:
            await c.say("Talk.")
            await c.send("response.create", response={"max_output_tokens": 60})
        for c in sessions:
            await c.until("response.output_text.delta")
        metrics = (await client.get(server.url + "/metrics")).text
        assert re.search(r'turbospark_batch_size\{model="scripted"\} 3', metrics), metrics[:2000]
        await http.aclose()


async def test_tools_are_checked_as_chat_checks_them_and_the_other_events_answer(start_server) -> None:
    """Tools refused at session.update (as chat refuses them), tool_choice naming one function,
    max_output_tokens ending an answer as incomplete, G.711 both ways, clear and delete."""
    server = await _audio_server(start_server)
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}
    time = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    async with open_websocket_url(_url(server)) as ws:
        c = await _session(ws)
        for tools, wanted in (([weather] * 129, "at most 128 tools"), ([{**weather, "name": "no spaces"}], "name"),
                              ([{**weather, "parameters": {"type": "object", "properties": 3}}], "parameters")):
            await c.send("session.update", session={"type": "realtime", "tools": tools})
            error = (await c.recv())["error"]
            assert error["param"] == "tools" and wanted in error["message"], error
        await c.send("session.update", session={"type": "realtime", "tools": [weather],
                                                "tool_choice": {"type": "function", "name": "x"}})
        assert "not among the tools" in (await c.recv())["error"]["message"]
        await c.send("session.update", session={
            "type": "realtime", "output_modalities": ["audio"], "tools": [weather, time],
            "tool_choice": {"type": "function", "name": "get_time"},
            "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcma"}}}})
        assert (await c.recv())["type"] == "session.updated"
        await c.say("What time is it?")
        await c.send("response.create", response={"output_modalities": ["text"]})
        done = (await c.until("response.done"))[-1]["response"]
        assert [(o["type"], o["name"]) for o in done["output"]] == [("function_call", "get_time")]

        await c.send("response.create", response={"tool_choice": "none", "max_output_tokens": 3})
        events = await c.until("response.done")
        done = events[-1]["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
        assert done["usage"]["output_tokens"] == 3
        audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        said = done["output"][0]["content"][0]["transcript"]
        assert said and len(audio) == round(len(said) * 0.05 * 8000)  # A-law: a byte a sample at 8 kHz
        await c.send("conversation.item.delete", item_id=done["output"][0]["id"])
        assert (await c.recv()) == {**c.seen[-1], "type": "conversation.item.deleted", "item_id": done["output"][0]["id"]}

        await c.send("input_audio_buffer.append", audio=base64.b64encode(b"\xff" * 1600).decode())  # 0.2 s of mu-law
        await c.send("input_audio_buffer.clear")
        assert (await c.recv())["type"] == "input_audio_buffer.cleared"
        await c.send("input_audio_buffer.commit")
        assert (await c.recv())["error"]["code"] == "input_audio_buffer_commit_empty"
        await c.send("input_audio_buffer.append", audio=base64.b64encode(b"\xff" * 4000).decode())  # 0.5 s
        await c.send("input_audio_buffer.commit")
        completed = (await c.until("conversation.item.input_audio_transcription.completed"))[-1]
        assert completed["transcript"] == "Scripted transcript of 0.50 s of audio."


async def test_a_foreign_origin_is_refused_and_sessions_beyond_the_limit_get_a_429(start_server) -> None:
    from contextlib import AsyncExitStack

    from trio_websocket import ConnectionRejected

    server = await _audio_server(start_server)
    with pytest.raises(ConnectionRejected) as refused:
        async with open_websocket_url(_url(server), extra_headers=[("origin", "https://evil.example")]):
            pass
    assert refused.value.status_code == 403
    async with AsyncExitStack() as open_sessions:
        for _ in range(8):  # the sessions the server holds at once, shared with the transcription socket
            ws = await open_sessions.enter_async_context(open_websocket_url(_url(server)))
            assert (await Client(ws).recv())["type"] == "session.created"
        with pytest.raises(ConnectionRejected) as refused:
            async with open_websocket_url(_url(server)):
                pass
        assert refused.value.status_code == 429
    async with open_websocket_url(_url(server), extra_headers=[("origin", "http://localhost:3000")]) as ws:
        assert (await Client(ws).recv())["type"] == "session.created"  # a slot is free again
