"""The images actor on the scripted image model (no weights, paced steps): deterministic images,
edits (a truncated or too large upload refused by name, before any job), and every way a job
ends: a client leaving while its job waits (dropped before it starts) or runs (stopped at its
next step), a full queue (the retryable 503), shutdown mid-run (503), each counted in
``/metrics``.  The hang-ups go over raw sockets to a real Hypercorn."""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import trio
from PIL import Image

from turbospark.cli.attach import image_specs
from turbospark.config import Settings
from turbospark.images.messages import ImageJobBegan, ImageJobEnded
from turbospark.images.scripted import SCRIPTED_IMAGE_ID, ScriptedImages

from ._support import raw_post, read_until

BODY = {"model": SCRIPTED_IMAGE_ID, "prompt": "a lighthouse", "size": "32x16", "steps": 3}


def _rgb(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _next(events: trio.MemoryReceiveChannel, kind: type) -> object:
    with trio.fail_after(30):
        async for event in events:
            if isinstance(event, kind):
                return event
    raise AssertionError("the events ended")


async def test_scripted_images_are_deterministic_and_edits_blend(start_server, client) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0)])
    one = (await client.post(f"{server.url}/v1/images/generations", json={**BODY, "seed": 1, "n": 2})).json()
    again = (await client.post(f"{server.url}/v1/images/generations", json={**BODY, "seed": 1, "n": 2})).json()
    other = (await client.post(f"{server.url}/v1/images/generations", json={**BODY, "seed": 2})).json()
    images = [_rgb(d["b64_json"]) for d in one["data"]]
    assert [i.shape for i in images] == [(16, 32, 3)] * 2 and not np.array_equal(images[0], images[1])
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in one["data"]]
    assert other["data"][0]["b64_json"] != one["data"][0]["b64_json"]

    white = io.BytesIO()
    Image.new("RGB", (32, 16), (255, 255, 255)).save(white, "PNG")
    r = await client.post(f"{server.url}/v1/images/edits", data={"model": SCRIPTED_IMAGE_ID, "prompt": "a lighthouse",
                          "seed": "1", "strength": "0", "steps": "2"}, files={"image": ("w.png", white.getvalue())})
    assert r.status_code == 200 and (_rgb(r.json()["data"][0]["b64_json"]) == 255).all()  # strength 0: kept
    models = (await client.get(f"{server.url}/v1/models")).json()["data"]
    assert next(m for m in models if m["id"] == SCRIPTED_IMAGE_ID)["capabilities"] == ["text_to_image"]
    ollama = await client.post(f"{server.url}/api/generate", json={"model": SCRIPTED_IMAGE_ID, "prompt": "hi"})
    assert ollama.status_code == 400 and "does not support generate" in ollama.json()["error"]


async def test_a_truncated_or_too_large_upload_to_edits_is_a_400_naming_image(start_server, client) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0)])
    form = {"model": SCRIPTED_IMAGE_ID, "prompt": "a lighthouse", "steps": "1"}
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 32, 3), dtype=np.uint8)).save(png, "PNG")
    whole = png.getvalue()
    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, "PNG")  # 36 million pixels in a few kilobytes
    assert len(bomb.getvalue()) < 10_000

    # its signature and header (the size is known) and a scrap of its pixel data
    r = await client.post(f"{server.url}/v1/images/edits", data=form,
                          files={"image": ("t.png", whole[:60], "image/png")})  # fmt: skip
    assert r.status_code == 400 and list(r.json()) == ["error"]
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "image", None)
    assert error["message"].startswith("'image': the image could not be decoded; the file is truncated or corrupt")

    r = await client.post(f"{server.url}/v1/images/edits", data=form, files={"image": ("b.png", bomb.getvalue())})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    assert r.json()["error"]["message"] == (
        "'image': the image is too large: 6000x6000 pixels, 36,000,000 in all, over the 16,777,216 an image may have")

    metrics = (await client.get(f"{server.url}/metrics")).text
    assert _metric(metrics, 'turbospark_image_jobs_total{kind="edit",outcome="done"}') == 0  # no job for either
    r = await client.post(f"{server.url}/v1/images/edits", data=form, files={"image": ("w.png", whole, "image/png")})
    assert r.status_code == 200 and _rgb(r.json()["data"][0]["b64_json"]).shape == (16, 32, 3)  # and it keeps serving
    with trio.fail_after(10):  # the job's end reaches the metrics through the observer, after the answer
        while _metric((await client.get(f"{server.url}/metrics")).text,
                      'turbospark_image_jobs_total{kind="edit",outcome="done"}') != 1:
            await trio.sleep(0.05)


async def test_a_job_whose_client_left_while_it_waited_never_runs(start_server, client) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0.05)])
    events = server.system.subscribe()
    first = await raw_post(server.url, "/v1/images/generations", {**BODY, "steps": 40})
    await _next(events, ImageJobBegan)
    second = await raw_post(server.url, "/v1/images/generations", {**BODY, "steps": 40, "prompt": "second"})
    await trio.sleep(0.3)  # taken by the actor, waiting in the model's queue
    await second.aclose()
    ended = await _next(events, ImageJobEnded)
    assert (ended.outcome, ended.steps) == ("done", 40)  # the first ran to its end
    ended = await _next(events, ImageJobEnded)
    assert (ended.outcome, ended.phase, ended.steps) == ("cancelled", "queued", 0)
    await first.aclose()
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert _metric(metrics, 'turbospark_image_cancellations_total{phase="queued"}') == 1


async def test_a_full_queue_is_the_retryable_503(start_server, client) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0.05)], max_queue=1)
    events = server.system.subscribe()
    running = await raw_post(server.url, "/v1/images/generations", {**BODY, "steps": 100})
    await _next(events, ImageJobBegan)
    waiting = await raw_post(server.url, "/v1/images/generations", {**BODY, "steps": 100})
    await trio.sleep(0.3)
    r = await client.post(f"{server.url}/v1/images/generations", json=BODY)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["retryable"] is True
    for stream in (waiting, running):
        await stream.aclose()
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert _metric(metrics, "turbospark_image_busy_total") == 1


async def test_a_stream_that_hangs_up_stops_at_the_next_step(start_server, client) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0.05)])
    events = server.system.subscribe()
    stream = await raw_post(server.url, "/v1/images/generations", {**BODY, "steps": 100, "stream": True})
    await read_until(stream, b": step 3/100")
    await stream.aclose()
    ended = await _next(events, ImageJobEnded)
    assert (ended.outcome, ended.phase) == ("cancelled", "running") and 3 <= ended.steps <= 5
    ok = await client.post(f"{server.url}/v1/images/generations", json=BODY)
    assert ok.status_code == 200  # the thread took the next job


async def test_shutdown_mid_run_answers_the_job_503(start_server) -> None:
    server = await start_server(images=[ScriptedImages(step_delay=0.05)])
    events = server.system.subscribe()
    answers: list[httpx.Response] = []

    async def ask() -> None:
        async with httpx.AsyncClient(timeout=30) as h:
            answers.append(await h.post(f"{server.url}/v1/images/generations", json={**BODY, "steps": 100}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await _next(events, ImageJobBegan)
        server.stop.set()
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]


def test_serve_with_only_scripted_models_attaches_the_scripted_image_model() -> None:
    assert [s.id for s in image_specs(Settings(models=["scripted"]))] == [SCRIPTED_IMAGE_ID]
    assert image_specs(Settings(models=["smollm2-135m-instruct"])) == []
