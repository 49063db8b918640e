"""Fault injection (decision 0019): a fault at any named point fails the request that met it,
with a 500 in its family's shape and an error id, and nothing else; the server keeps serving
and its gauges return to zero."""

from __future__ import annotations

import re

import pytest
import trio

from turbospark import errors
from turbospark.audio.engines import ScriptedSpeechToText
from turbospark.model.encoder import ScriptedEncoder
from turbospark.model.scripted import ScriptedBackend

from ._support import chat_body, wait_for
from .test_mlx_server import mlx_server  # noqa: F401  (the real-model server fixture)

PATH = "/v1/chat/completions"
GENERATION_POINTS = ["admission", "prefill chunk", "decode step", "delivery", "stop", "prefix-cache store"]


@pytest.fixture(autouse=True)
def _disarmed():
    errors._armed.clear()
    errors._rates.clear()
    yield
    errors._armed.clear()
    errors._rates.clear()


def test_a_point_armed_with_a_rate_fails_about_that_share_of_passes(monkeypatch) -> None:
    monkeypatch.setenv("TURBOSPARK_FAULTS", "decode step:10%, stop:2")
    errors._arm_from_environment()
    assert errors._rates == {"decode step": 0.1} and errors._armed == {"stop": 2}
    failed = 0
    for _ in range(2000):
        try:
            errors.inject("decode step")
        except errors.InjectedFault:
            failed += 1
    assert 120 < failed < 280  # 10 % of 2000, give or take


def test_every_point_is_named_and_unknown_points_are_refused() -> None:
    assert set(GENERATION_POINTS) | {"encoder batch", "audio job", "image job", "resolver load", "observer write"} == set(
        errors.FAULT_POINTS)
    with pytest.raises(ValueError):
        errors.arm("nowhere")


async def _gauges_at_zero(client, url: str) -> None:
    async def zero() -> bool:
        text = (await client.get(f"{url}/metrics")).text
        values = re.findall(r"^turbospark_(?:generations_in_flight|queue_depth|batch_size)\S* (\S+)$", text, re.M)
        return bool(values) and all(float(v) == 0 for v in values)

    with trio.fail_after(10):
        while not await zero():
            await trio.sleep(0.02)


@pytest.mark.parametrize("point", GENERATION_POINTS)
async def test_a_fault_fails_its_request_alone(start_server, client, point) -> None:
    server = await start_server(backends=[ScriptedBackend(token_delay=0.002)])
    body = chat_body("word " * 40, max_tokens=24)
    expected = (await client.post(f"{server.url}{PATH}", json=body)).json()["choices"][0]["message"]["content"]
    errors.arm(point)
    results: list = []

    async def one() -> None:
        results.append(await client.post(f"{server.url}{PATH}", json=body))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    assert not errors._armed  # the fault fired
    failed = [r for r in results if r.status_code != 200]
    assert len(failed) == 1, [r.text for r in results]
    error = failed[0].json()["error"]
    assert failed[0].status_code == 500 and error["type"] == "server_error"
    assert re.search(r"error id [0-9a-f]{12}", error["message"])
    assert [r.json()["choices"][0]["message"]["content"] for r in results if r.status_code == 200] == [expected] * 3
    again = await client.post(f"{server.url}{PATH}", json=body)  # the model thread carries on
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected
    await _gauges_at_zero(client, server.url)
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert re.findall(r"^turbospark_job_faults_total\{[^}]*\} (\S+)$", metrics, re.M) == ["1.0"]
    await _faults_counted(client, server.url, "model")


async def _faults_counted(client, url: str, actor: str) -> None:
    """``/health/live`` and ``/metrics`` count one fault, of ``actor``, and none of the others;
    the server is healthy and live."""
    assert (await client.get(f"{url}/health")).json()["status"] == "ok"
    live = (await client.get(f"{url}/health/live")).json()
    assert live == {"status": "live", "faults": {a: int(a == actor) for a in ("model", "encoder", "audio", "image", "observer")}}
    metrics = (await client.get(f"{url}/metrics")).text
    assert f'turbospark_faults{{actor="{actor}"}} 1.0' in metrics
    assert len(re.findall(r'^turbospark_faults\{actor="\w+"\} 0\.0$', metrics, re.M)) == 4


async def test_a_fault_in_an_encoder_batch_fails_that_batch_and_the_encoder_carries_on(start_server, client) -> None:
    server = await start_server(encoders=[ScriptedEncoder()])
    errors.arm("encoder batch")
    r = await client.post(f"{server.url}/v1/embeddings", json={"model": "scripted-embed", "input": "one"})
    assert r.status_code == 500 and re.search(r"error id [0-9a-f]{12}", r.json()["error"]["message"])
    r = await client.post(f"{server.url}/v1/embeddings", json={"model": "scripted-embed", "input": "one"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    await _faults_counted(client, server.url, "encoder")


async def test_a_fault_in_an_audio_job_fails_that_job_and_the_worker_carries_on(start_server, client) -> None:
    from .test_audio_api import tone, upload

    server = await start_server(audio=[ScriptedSpeechToText()])
    errors.arm("audio job")
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(0.5)))
    assert r.status_code == 500 and re.search(r"error id [0-9a-f]{12}", r.json()["error"]["message"])
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload(audio=tone(0.5)))
    assert r.status_code == 200 and "0.50 s" in r.json()["text"]
    await _faults_counted(client, server.url, "audio")


async def test_a_fault_while_loading_fails_the_load_and_the_next_request_loads_again(start_server, client) -> None:
    from .test_lifecycle import Shelf, chat

    shelf = Shelf("alpha")
    server = await start_server(library=shelf.models)
    errors.arm("resolver load")
    r = await client.post(f"{server.url}/api/chat", json=chat("alpha"))
    assert r.status_code == 503 and "error" in r.json()
    r = await client.post(f"{server.url}/api/chat", json=chat("alpha"))
    assert r.status_code == 200 and r.json()["message"]["content"] == "Loaded and answering."
    assert (await client.get(f"{server.url}/health")).status_code == 200


async def test_a_fault_writing_the_events_file_keeps_the_metrics(start_server, client, tmp_path) -> None:
    events = tmp_path / "events.jsonl"
    server = await start_server(events_path=events)
    await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
    await wait_for(lambda: events.exists() and events.stat().st_size > 0)
    errors.arm("observer write")
    for _ in range(2):
        r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
        assert r.status_code == 200
    text = (await client.get(f"{server.url}/metrics")).text
    assert re.search(r'^turbospark_requests_total\{[^}]*status="200"[^}]*\} (\d+)', text, re.M)
    await wait_for(lambda: server.system.observer.faults["observer"] == 1)
    await _faults_counted(client, server.url, "observer")


async def test_a_decode_fault_on_the_real_model_fails_one_request_alone(mlx_server, client) -> None:
    body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}
    body["model"] = (await client.get(f"{mlx_server.url}/v1/models")).json()["data"][0]["id"]
    expected = (await client.post(f"{mlx_server.url}{PATH}", json=body)).json()["choices"][0]["message"]["content"]
    errors.arm("decode step")
    results: list = []

    async def one() -> None:
        results.append(await client.post(f"{mlx_server.url}{PATH}", json=body))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert sorted(r.status_code for r in results) == [200, 200, 500]
    assert [r.json()["choices"][0]["message"]["content"] for r in results if r.status_code == 200] == [expected] * 2
    assert (await client.post(f"{mlx_server.url}{PATH}", json=body)).json()["choices"][0]["message"]["content"] == expected
    await _gauges_at_zero(client, mlx_server.url)


async def test_a_slow_events_file_never_holds_the_metrics_back(start_server, client, tmp_path, monkeypatch) -> None:
    """A disk that takes half a second for every write: the metrics count every request as
    it ends, and the file gets its lines later, several in one write."""
    from turbospark.actors import _events_file

    writes: list[str] = []

    class SlowDisk:
        async def write(self, text: str) -> None:
            await trio.sleep(0.5)
            writes.append(text)

        async def flush(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    async def open_slow(path):  # type: ignore[no-untyped-def]
        return SlowDisk()

    monkeypatch.setattr(_events_file, "_open_events", open_slow)
    server = await start_server(events_path=tmp_path / "events.jsonl")
    for _ in range(8):
        r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
        assert r.status_code == 200
    text = (await client.get(f"{server.url}/metrics")).text
    assert sum(float(v) for v in re.findall(r'^turbospark_requests_total\{route="/v1/chat/completions",status="200"\} (\S+)', text, re.M)) == 8
    assert "turbospark_observer_dropped_events 0.0" in text
    await wait_for(lambda: sum(line.count("\n") for line in writes) >= 8 * 3)
    assert len(writes) < 8 * 3  # what waited went in one write
