"""The audio routes against the scripted engines: formats, limits, errors, jobs, models, metrics."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import numpy as np
import pytest
import trio

from turbospark.audio import wav
from turbospark.audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech

from ._support import wait_for


def tone(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    n = int(seconds * rate)
    x = (0.2 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32)
    pcm = np.repeat(x[:, None], channels, axis=1).reshape(-1)
    return wav.encode(wav.to_s16(pcm), rate, channels)


async def audio_server(start_server, stt=None, tts=None, **settings):  # type: ignore[no-untyped-def]
    stt = stt or ScriptedSpeechToText()
    tts = tts or ScriptedTextToSpeech()
    return await start_server(audio=[stt, tts], **settings)


def upload(model: str = "scripted-stt", audio: bytes | None = None, **fields: str):  # type: ignore[no-untyped-def]
    return {"files": {"file": ("a.wav", audio if audio is not None else tone(1.0), "audio/wav")},
            "data": {"model": model, **fields}}


async def metrics(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/metrics")).text


async def test_audio_routes_do_not_exist_without_an_audio_model(start_server, client):
    server = await start_server()
    r = await client.post(f"{server.url}/v1/audio/transcriptions", content=tone(0.1))
    assert r.status_code == 404
    assert (await client.get(f"{server.url}/v1/audio/models")).status_code == 404


async def test_transcription_formats(start_server, client):
    server = await audio_server(start_server, ScriptedSpeechToText(segment_seconds=0.5))
    url = f"{server.url}/v1/audio/transcriptions"
    r = await client.post(url, **upload())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"text": "Part 1 of scripted transcript of 1.00 s of audio. Part 2 of scripted transcript of 1.00 s of audio."}
    r = await client.post(url, **upload(response_format="verbose_json", language="EN"))
    body = r.json()
    assert body["task"] == "transcribe" and body["language"] == "en" and body["duration"] == 1.0
    assert [(s["id"], s["start"], s["end"]) for s in body["segments"]] == [(0, 0.0, 0.5), (1, 0.5, 1.0)]
    r = await client.post(url, **upload(response_format="text"))
    assert r.headers["content-type"].startswith("text/plain") and r.text.endswith(".\n")
    r = await client.post(url, **upload(response_format="srt"))
    assert r.text.startswith("1\n00:00:00,000 --> 00:00:00,500\nPart 1 of scripted transcript")
    assert "\n\n2\n00:00:00,500 --> 00:00:01,000\n" in r.text
    r = await client.post(url, **upload(response_format="vtt"))
    assert r.headers["content-type"].startswith("text/vtt") and r.text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:00.500\n")


async def test_transcription_downmixes_and_resamples_to_16k_mono(start_server, client):
    stt = ScriptedSpeechToText()
    server = await audio_server(start_server, stt)
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(0.5, 48000, 2)))
    assert r.status_code == 200
    assert stt.calls == [8000]


async def test_transcription_accepts_a_raw_wav_body_with_query_options(start_server, client):
    server = await audio_server(start_server)
    r = await client.post(
        f"{server.url}/v1/audio/transcriptions?model=scripted-stt&response_format=text",
        content=tone(0.25), headers={"content-type": "audio/wav"},
    )
    assert r.status_code == 200 and r.text == "Scripted transcript of 0.25 s of audio.\n"


@pytest.mark.parametrize(
    ("fields", "status", "needle"),
    [
        ({"model": ""}, 400, "model is required"),
        ({"model": "nope"}, 404, "nope"),
        ({"model": "scripted-tts"}, 400, "text-to-speech model"),
        ({"prompt": "hi"}, 400, "prompt"),
        ({"temperature": "0.5"}, 400, "temperature"),
        ({"timestamp_granularities[]": "word"}, 400, "granularity"),
        ({"colour": "red"}, 400, 'the field "colour" is not supported by this server'),
        ({"response_format": "mp3"}, 400, "response_format"),
        ({"stream": "true", "async": "true"}, 400, "both"),
        ({"stream": "maybe"}, 400, "stream"),
        ({"language": "en us!"}, 400, "language"),
    ],
)
async def test_transcription_refuses_what_it_cannot_do(start_server, client, fields, status, needle):
    stt = ScriptedSpeechToText()
    server = await audio_server(start_server, stt)
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(**fields))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and "param" in error
    assert stt.calls == []  # the model is never called


async def test_transcription_refuses_bad_audio_and_bodies(start_server, client):
    stt = ScriptedSpeechToText()
    server = await audio_server(start_server, stt)
    url = f"{server.url}/v1/audio/transcriptions"
    r = await client.post(url, **upload(audio=b"ID3 not a wav at all"))
    assert r.status_code == 415 and "WAV" in r.json()["error"]["message"]
    r = await client.post(url, **upload(audio=wav.encode(b"", 16000)))
    assert r.status_code == 400 and "no samples" in r.json()["error"]["message"]
    r = await client.post(url, data={"model": "scripted-stt"}, files={"other": ("x", b"1")})
    assert r.status_code == 400
    r = await client.post(url, content=b"hello", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = await client.post(f"{server.url}/v1/audio/translations", **upload())
    assert r.status_code == 501 and r.json()["error"]["message"] == "audio translation is unsupported; use /v1/audio/transcriptions"
    assert stt.calls == []


async def test_transcription_rejects_audio_longer_than_the_cap(start_server, client):
    server = await audio_server(start_server)
    long = wav.encode(b"\0\0" * (8000 * 1801), 8000)
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=long))
    assert r.status_code == 400 and r.json()["error"]["message"] == "audio is 1801.0 s; the limit is 1800 s"


async def test_upload_limit_is_larger_than_the_chat_limit_and_still_enforced(start_server, client):
    server = await audio_server(start_server)
    big = wav.encode(b"\0\0" * (15 * 1024 * 1024), 16000)  # 30 MiB, 983 s
    r = await client.post(f"{server.url}/v1/audio/transcriptions?model=scripted-stt", content=big)
    assert r.status_code == 200
    r = await client.post(f"{server.url}/v1/audio/transcriptions?model=scripted-stt", content=b"\0" * (128 * 1024 * 1024 + 1))
    assert r.status_code == 413 and "128 MiB" in r.json()["error"]["message"]


async def test_busy_is_a_429_with_retry_after(start_server, client):
    stt = ScriptedSpeechToText(step_delay=0.05)
    server = await audio_server(start_server, stt)
    results: list[httpx.Response] = []

    async def one() -> None:
        results.append(await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(2.0))))

    async with trio.open_nursery() as nursery:
        for _ in range(7):  # one running, four queued, the rest refused
            nursery.start_soon(one)
    busy = [r for r in results if r.status_code == 429]
    assert busy and all(r.headers["retry-after"] == "2" for r in busy)
    assert busy[0].json()["error"]["message"] == "the audio queue is full; retry shortly"
    assert f"turbospark_audio_busy_total {float(len(busy))}" in await metrics(client, server.url)


async def test_ndjson_streams_start_segments_and_complete(start_server, client):
    server = await audio_server(start_server, ScriptedSpeechToText(segment_seconds=0.5))
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(stream="true"))
    assert r.headers["content-type"] == "application/x-ndjson" and r.headers["cache-control"] == "no-cache"
    events = [json.loads(line) for line in r.text.splitlines()]
    assert [e["type"] for e in events] == ["start", "segment", "segment", "complete"]
    assert events[0]["model"] == "scripted-stt" and events[-1]["duration"] == 1.0


async def test_async_transcription_job_lifecycle(start_server, client):
    stt = ScriptedSpeechToText(step_delay=0.02)
    server = await audio_server(start_server, stt)
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(**{"async": "true", "response_format": "text"}))
    assert r.status_code == 202
    job = r.json()
    assert job["object"] == "audio.job" and job["status"] == "running" and job["id"].startswith("job_")
    assert job["poll_url"] == f"/v1/audio/jobs/{job['id']}"
    r = await client.get(f"{server.url}/v1/audio/jobs/{job['id']}/result")
    assert r.status_code == 409 and "still running" in r.json()["error"]["message"]
    for _ in range(200):
        state = (await client.get(f"{server.url}{job['poll_url']}")).json()
        if state["status"] != "running":
            break
        await trio.sleep(0.02)
    assert state["status"] == "succeeded" and state["kind"] == "transcription" and state["result_url"]
    r = await client.get(f"{server.url}{state['result_url']}")
    assert r.status_code == 200 and r.text == "Scripted transcript of 1.00 s of audio.\n"
    r = await client.delete(f"{server.url}/v1/audio/jobs/{job['id']}")
    assert r.json() == {"id": job["id"], "deleted": True}
    r = await client.get(f"{server.url}/v1/audio/jobs/{job['id']}")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such job"


async def test_cancelling_a_running_job_stops_its_work_and_blocks_unload(start_server, client):
    stt = ScriptedSpeechToText(step_delay=0.05)
    server = await audio_server(start_server, stt)
    job = (await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(30.0), **{"async": "true"}))).json()
    await wait_for(lambda: stt.steps > 2)
    r = await client.delete(f"{server.url}/v1/audio/models/scripted-stt")
    assert r.status_code == 409
    r = await client.delete(f"{server.url}/v1/audio/jobs/{job['id']}")
    assert r.json() == {"id": job["id"], "status": "cancelled"}
    await trio.sleep(0.3)
    steps = stt.steps
    await trio.sleep(0.3)
    assert stt.steps == steps < 300  # stopped, far from the 300 steps of 30 s
    r = await client.get(f"{server.url}/v1/audio/jobs/{job['id']}/result")
    assert r.status_code == 410
    text = await metrics(client, server.url)
    assert 'turbospark_audio_cancellations_total{phase="running"} 1.0' in text
    assert "turbospark_audio_in_flight 0.0" in text
    assert 'turbospark_audio_jobs{status="cancelled"} 1.0' in text


async def test_too_many_unfinished_jobs_is_a_429(start_server, client):
    server = await audio_server(start_server, ScriptedSpeechToText(step_delay=0.05))
    statuses = []
    for _ in range(9):
        r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(5.0), **{"async": "true"}))
        statuses.append(r.status_code)
    assert statuses == [202] * 8 + [429]


async def test_unknown_job_is_404(start_server, client):
    server = await audio_server(start_server)
    for method in ("GET", "DELETE"):
        r = await client.request(method, f"{server.url}/v1/audio/jobs/job_0000000000000000")
        assert r.status_code == 404 and r.json()["error"]["param"] == "id"


async def test_a_client_that_leaves_stops_its_transcription(start_server, client):
    stt = ScriptedSpeechToText(step_delay=0.05)
    server = await audio_server(start_server, stt)
    with trio.move_on_after(0.4):
        await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(30.0)))
    await trio.sleep(0.3)
    steps = stt.steps
    await trio.sleep(0.3)
    assert stt.steps == steps < 30
    assert 'turbospark_audio_cancellations_total{phase="running"} 1.0' in await metrics(client, server.url)


async def test_speech_wav_pcm_and_chunked_pcm(start_server, client):
    tts = ScriptedTextToSpeech()
    server = await audio_server(start_server, tts=tts)
    url = f"{server.url}/v1/audio/speech"
    r = await client.post(url, json={"model": "scripted-tts", "input": "Hi there."})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.headers["x-audio-sample-rate"] == "24000"
    samples, rate = wav.read(r.content)
    assert rate == 24000 and len(samples) == 9 * 1200
    r = await client.post(url, json={"model": "tts-1", "text": "Hi.", "response_format": "pcm", "voice": "alloy"})
    assert r.headers["content-type"] == "audio/pcm" and len(r.content) == 3 * 1200 * 2
    async with client.stream("POST", url, json={"model": "scripted-tts", "input": "One. Two. Three.", "response_format": "pcm", "stream": True}) as r:
        chunks = [c async for c in r.aiter_raw()]
    assert sum(map(len, chunks)) == (4 + 5 + 7) * 1200 * 2
    assert tts.calls[-1] == ("One. Two. Three.", "af_heart", 1.0)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "x"}, "model is required"),
        ({"model": "scripted-tts", "input": "  "}, "blank"),
        ({"model": "scripted-tts", "input": "x" * 4097}, "4097"),
        ({"model": "scripted-tts", "input": "x", "response_format": "mp3"}, 'response_format "mp3" is not supported; use wav or pcm'),
        ({"model": "scripted-tts", "input": "x", "stream": True}, "stream"),
        ({"model": "scripted-tts", "input": "x", "speed": 3}, "speed"),
        ({"model": "scripted-tts", "input": "x", "speed": "fast"}, "speed"),
        ({"model": "scripted-tts", "input": "x", "voice": "nobody"}, "voice"),
        ({"model": "scripted-tts", "input": "x", "pitch": 2}, "pitch"),
        ({"model": "scripted-stt", "input": "x"}, "speech-to-text model"),
    ],
)
async def test_speech_validation(start_server, client, body, needle):
    tts = ScriptedTextToSpeech()
    server = await audio_server(start_server, tts=tts)
    r = await client.post(f"{server.url}/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert tts.calls == []


async def test_generate_validates_and_has_no_music_model(start_server, client):
    server = await audio_server(start_server)
    url = f"{server.url}/v1/audio/generate"
    r = await client.post(url, json={"model": "music", "prompt": "jazz", "guidance_scale": 3})
    assert r.status_code == 400 and "guidance_scale" in r.json()["error"]["message"]
    r = await client.post(url, json={"model": "music", "prompt": "jazz", "audio_length": 400})
    assert r.status_code == 400
    r = await client.post(url, json={"model": "music", "prompt": "jazz"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_models_are_listed_on_both_surfaces_and_managed(start_server, client):
    from turbospark.cli.attach import audio_catalogue

    server = await audio_server(start_server, audio_catalogue=audio_catalogue())
    r = await client.get(f"{server.url}/v1/audio/models")
    assert [(m["id"], m["task"], m["capabilities"]) for m in r.json()["data"]] == [
        ("scripted-stt", "speech_to_text", ["speech_to_text"]),
        ("scripted-tts", "text_to_speech", ["text_to_speech"]),
    ]
    rows = (await client.get(f"{server.url}/v1/models")).json()["data"]
    assert {r["id"]: r.get("capabilities") for r in rows}["scripted-stt"] == ["speech_to_text"]
    detail = (await client.get(f"{server.url}/v1/models/scripted-stt")).json()
    assert detail["id"] == "scripted-stt" and detail["capabilities"] == ["speech_to_text"]
    r = await client.delete(f"{server.url}/v1/audio/models/scripted-tts")
    assert r.json() == {"id": "scripted-tts", "deleted": True}
    assert (await client.delete(f"{server.url}/v1/audio/models/scripted-tts")).status_code == 404
    r = await client.post(f"{server.url}/v1/audio/models", json={"model_id": "scripted-tts"})
    assert r.status_code == 201 and r.json()["task"] == "text_to_speech"
    assert (await client.post(f"{server.url}/v1/audio/models", json={"model_id": "/tmp/x"})).status_code == 404
    assert (await client.post(f"{server.url}/v1/audio/models", json={"model_id": " "})).status_code == 400
    assert (await client.post(f"{server.url}/v1/audio/models", json={"model_id": "x", "force": 1})).status_code == 400
    text = await metrics(client, server.url)
    assert "turbospark_audio_models_loaded 2.0" in text
    assert 'turbospark_audio_requests_total{endpoint="models_unload",status="200"} 1.0' in text
    assert 'turbospark_audio_requests_total{endpoint="models_load",status="201"} 1.0' in text


async def test_audio_routes_require_the_api_key_but_health_does_not(start_server, client):
    server = await audio_server(start_server, api_key="secret")
    assert (await client.post(f"{server.url}/v1/audio/transcriptions", **upload())).status_code == 401
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(), headers={"authorization": "Bearer secret"})
    assert r.status_code == 200
    assert (await client.get(f"{server.url}/health")).status_code == 200


def test_wav_reads_every_sample_format():
    x = np.array([0.0, 0.5, -0.5, 0.25], np.float32)
    for bits, data in ((16, (x * 32768).astype("<i2").tobytes()),):
        assert np.allclose(wav.read(wav.encode(data, 8000))[0], x, atol=1e-4)
    f32 = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + 16, b"WAVE", b"fmt ", 16, 3, 1, 8000, 32000, 4, 32, b"data", 16) + x.tobytes()
    assert np.allclose(wav.read(f32)[0], x)
    b24 = b"".join(int(v * (1 << 23)).to_bytes(3, "little", signed=True) for v in x)
    p24 = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + 12, b"WAVE", b"fmt ", 16, 1, 1, 8000, 24000, 3, 24, b"data", 12) + b24
    assert np.allclose(wav.read(p24)[0], x, atol=1e-6)
    assert len(wav.decode(wav.encode(b"\0\0" * 48000, 48000))) == 16000


async def test_input_audio_parts_in_chat_messages_are_transcribed_for_a_text_model(start_server, client) -> None:
    """OpenAI's ``input_audio`` parts: the speech-to-text model's transcript takes each one's
    place in the message, as text, and the degradation header says so."""
    stt = ScriptedSpeechToText()
    server = await audio_server(start_server, stt)
    spoken = base64.b64encode(tone(1.0, rate=24000)).decode()
    heard = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What did I say?"},
        {"type": "input_audio", "input_audio": {"data": spoken, "format": "wav"}}]}]}
    read = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What did I say?"},
        {"type": "text", "text": "Scripted transcript of 1.00 s of audio."}]}]}
    r = await client.post(server.url + "/v1/chat/completions", json=heard)
    assert r.status_code == 200, r.text
    assert "input_audio (transcribed by scripted-stt)" in r.headers["x-anyllm-degradation"]
    assert stt.calls == [16000]  # one second, at the engine's rate
    same = await client.post(server.url + "/v1/chat/completions", json=read)
    assert r.json()["usage"]["prompt_tokens"] == same.json()["usage"]["prompt_tokens"]
    for bad, says in (({"data": spoken, "format": "mp3"}, "send wav"), ({"data": "not base64!"}, "base64 WAV"),
                      ({"format": "wav"}, "needs data")):
        body = {**heard, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": bad}]}]}
        r = await client.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert stt.calls == [16000]
    bare = await start_server()  # no speech-to-text model
    r = await client.post(bare.url + "/v1/chat/completions", json=heard)
    assert r.status_code == 400 and "no speech-to-text model" in r.json()["error"]["message"]
