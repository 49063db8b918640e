"""The Images API as a new user meets it: a tiny Z-Image pipeline written by Diffusers is imported
with ``turbospark models import``, served from the store (loaded on the first request), and asked
for images through the openai SDK (``b64_json`` and ``url``, streamed with partial images, edits);
bad input is a 400 naming the field; a client that hangs up mid-run stops it within a step and is
counted in ``/metrics``; two requests at once are run in turn."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import openai  # noqa: E402
from PIL import Image  # noqa: E402

from turbospark.config import Settings  # noqa: E402
from turbospark.images.messages import ImageJobBegan, ImageJobEnded  # noqa: E402
from turbospark.server import serve  # noqa: E402

from ._support import import_into, raw_post, read_until, sse_events  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .image_pipelines import tiny_zimage  # noqa: E402

MODEL = "tiny-zimage"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Z-Image pipeline, written by Diffusers."""
    out = tmp_path_factory.mktemp("diffusers") / "tiny-zimage"
    tiny_zimage(out)
    return out


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, pipeline: Path) -> Path:
    """A store holding the tiny pipeline, imported the way a user imports one."""
    home = tmp_path_factory.mktemp("home")
    assert MODEL in import_into(home, pipeline, MODEL)
    return home


def _png(data: bytes) -> Image.Image:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_the_openai_sdk_gets_pngs_by_b64_json_and_by_url(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    try:
        sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        got = await sdk.images.generate(model=MODEL, prompt="a lighthouse at dusk", size="64x96", n=2,
                                        response_format="b64_json", extra_body={"steps": 2, "seed": 7})  # fmt: skip
        images = [_png(base64.b64decode(item.b64_json or "")) for item in got.data]
        assert [(i.size, i.mode) for i in images] == [((64, 96), "RGB")] * 2
        assert got.size == "64x96" and got.output_format == "png" and got.usage is not None
        assert got.usage.output_tokens == 2 * (64 // 8) * (96 // 8) and got.usage.input_tokens > 0
        again = await sdk.images.generate(model=MODEL, prompt="a lighthouse at dusk", size="64x96", n=2,
                                          response_format="b64_json", extra_body={"steps": 2, "seed": 7})  # fmt: skip
        assert [d.b64_json for d in again.data] == [d.b64_json for d in got.data]  # the same seed, the same images

        by_url = await sdk.images.generate(model="dall-e-3", prompt="a lighthouse at dusk", size="64x64",
                                           response_format="url", extra_body={"steps": 2, "seed": 7})  # fmt: skip
        url = by_url.data[0].url or ""
        assert url.startswith(f"{server.url}/v1/images/files/") and url.endswith(".png")
        async with httpx.AsyncClient() as h:
            fetched = await h.get(url)
            assert fetched.headers["content-type"] == "image/png" and _png(fetched.content).size == (64, 64)
            missing = await h.get(f"{server.url}/v1/images/files/nothing.png")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"

            jpeg = await h.post(f"{server.url}/v1/images/generations", json={
                "model": MODEL, "prompt": "a fox", "size": "64x64", "output_format": "jpeg", "steps": 1})  # fmt: skip
            data = base64.b64decode(jpeg.json()["data"][0]["b64_json"])
            assert data[:3] == b"\xff\xd8\xff" and jpeg.headers["x-turbospark-seed"].isdigit()
            row = (await h.get(f"{server.url}/v1/models/{MODEL}")).json()
            assert row["capabilities"] == ["text_to_image", "image_to_image"] and row["architecture"] == "z-image"
            shown = (await h.post(f"{server.url}/api/show", json={"model": MODEL})).json()
            assert shown["capabilities"] == ["text_to_image", "image_to_image"]
            metrics = (await h.get(f"{server.url}/metrics")).text
        assert _metric(metrics, 'turbospark_image_jobs_total{kind="generation",outcome="done"}') == 4
        assert _metric(metrics, "turbospark_images_generated_total") == 6
    finally:
        server.stop.set()


async def test_an_image_model_loads_on_demand_and_unloads_when_idle(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home, keep_alive=1.0)
    try:
        async with httpx.AsyncClient(timeout=60) as h:
            assert (await h.get(f"{server.url}/api/ps")).json()["models"] == []
            r = await h.post(f"{server.url}/v1/images/generations",
                             json={"model": MODEL, "prompt": "x", "size": "64x64", "steps": 1})  # fmt: skip
            assert r.status_code == 200
            assert [m["model"] for m in (await h.get(f"{server.url}/api/ps")).json()["models"]] == [MODEL]
            assert _metric((await h.get(f"{server.url}/metrics")).text, "turbospark_image_models_loaded") == 1
            with trio.fail_after(20):  # keep_alive: unloaded once idle, its thread ended
                while (await h.get(f"{server.url}/api/ps")).json()["models"]:
                    await trio.sleep(0.1)
            assert _metric((await h.get(f"{server.url}/metrics")).text, "turbospark_image_models_loaded") == 0
    finally:
        server.stop.set()


async def test_a_stream_sends_partial_images_then_the_image(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    try:
        sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        stream = await sdk.images.generate(model=MODEL, prompt="a fox", size="64x64", stream=True, partial_images=2,
                                           extra_body={"steps": 4, "seed": 1})  # fmt: skip
        events = [event async for event in stream]
        assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
        assert [getattr(e, "partial_image_index", None) for e in events[:2]] == [0, 1]
        assert all(_png(base64.b64decode(e.b64_json)).size == (64, 64) for e in events)
        async with httpx.AsyncClient(timeout=60) as h:  # the steps ride as SSE comments
            r = await h.post(f"{server.url}/v1/images/generations", json={
                "model": MODEL, "prompt": "a fox", "size": "64x64", "stream": True, "steps": 3})  # fmt: skip
        assert re.findall(r"^: step (\d)/3$", r.text, re.M) == ["1", "2", "3"]
        assert [name for name, _ in sse_events(r.text)] == ["image_generation.completed"]
    finally:
        server.stop.set()


async def test_an_edit_redraws_the_uploaded_image(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    try:
        source = io.BytesIO()
        Image.new("RGB", (70, 50), (200, 30, 30)).save(source, "PNG")
        sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        got = await sdk.images.edit(model=MODEL, image=("red.png", source.getvalue(), "image/png"),
                                    prompt="make it blue", extra_body={"steps": 4, "strength": 0.5, "seed": 3})  # fmt: skip
        assert _png(base64.b64decode(got.data[0].b64_json or "")).size == (64, 48)  # its size, to the multiple of 8
        async with httpx.AsyncClient(timeout=60) as h:
            bad = await h.post(f"{server.url}/v1/images/edits", data={"model": MODEL, "prompt": "x"},
                               files={"image": ("x.png", b"not an image", "image/png")})  # fmt: skip
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "image"
            masked = await h.post(f"{server.url}/v1/images/edits", data={"model": MODEL, "prompt": "x"},
                                  files={"image": ("x.png", source.getvalue(), "image/png"),
                                         "mask": ("m.png", source.getvalue(), "image/png")})  # fmt: skip
            assert masked.status_code == 400 and masked.json()["error"]["param"] == "mask"
    finally:
        server.stop.set()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "size": "60x64"}, 400, "size"),
        ({"prompt": "x", "size": "big"}, 400, "size"),
        ({"prompt": "x", "size": "4096x4096"}, 400, "size"),
        ({"prompt": "x", "n": 11}, 400, "n"),
        ({"prompt": "   "}, 400, "prompt"),
        ({"prompt": "x" * 32_001}, 400, "prompt"),
        ({"prompt": "x", "output_format": "gif"}, 400, "output_format"),
        ({"prompt": "x", "response_format": "png"}, 400, "response_format"),
        ({"prompt": "x", "background": "transparent"}, 400, "background"),
        ({"prompt": "x", "partial_images": 2}, 400, "partial_images"),
        ({"prompt": "x", "steps": 0}, 400, "steps"),
        ({"prompt": "x", "mask": "y"}, 400, "mask"),
        ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ],
)
async def test_bad_requests_are_400s_naming_the_field(
    nursery: trio.Nursery, store_home: Path, body: dict[str, Any], status: int, param: str
) -> None:
    server = await _serve(nursery, store_home)
    try:
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(f"{server.url}/v1/images/generations", json={"model": MODEL, **body})
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
            assert r.json()["error"]["message"]
            ok = await h.post(f"{server.url}/v1/images/generations",
                              json={"model": MODEL, "prompt": "x", "size": "64x64", "steps": 1})  # fmt: skip
            assert ok.status_code == 200  # and it keeps serving
    finally:
        server.stop.set()


async def test_a_client_that_hangs_up_mid_run_stops_it_within_a_step(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    events = server.system.subscribe()
    try:
        body = {"model": MODEL, "prompt": "a long run", "size": "128x128", "steps": 100, "stream": True}
        stream = await raw_post(server.url, "/v1/images/generations", body)
        await read_until(stream, b": step 2/100", timeout=120)
        await stream.aclose()
        ended = None
        with trio.fail_after(30):
            async for event in events:
                if isinstance(event, ImageJobEnded):
                    ended = event
                    break
        assert ended is not None and (ended.outcome, ended.phase) == ("cancelled", "running")
        assert 2 <= ended.steps < 10  # it stopped at its next step, not at the end
        quiet = {"model": MODEL, "prompt": "quiet", "size": "128x128", "steps": 100}  # a plain request leaving
        stream = await raw_post(server.url, "/v1/images/generations", quiet)
        with trio.fail_after(60):
            async for event in events:
                if isinstance(event, ImageJobBegan):
                    break
        await stream.aclose()
        with trio.fail_after(30):
            async for event in events:
                if isinstance(event, ImageJobEnded):
                    assert (event.outcome, event.phase) == ("cancelled", "running") and event.steps < 100
                    break
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(f"{server.url}/metrics")).text
        assert _metric(metrics, 'turbospark_image_cancellations_total{phase="running"}') == 2
        assert _metric(metrics, 'turbospark_image_jobs_total{kind="generation",outcome="cancelled"}') == 2
        assert _metric(metrics, "turbospark_images_in_flight") == 0
    finally:
        server.stop.set()


async def test_a_fault_in_one_job_fails_that_job_alone(nursery: trio.Nursery, store_home: Path) -> None:
    from turbospark import errors

    server = await _serve(nursery, store_home)
    try:
        body = {"model": MODEL, "prompt": "x", "size": "64x64", "steps": 1}
        async with httpx.AsyncClient(timeout=60) as h:
            errors.arm("image job")
            r = await h.post(f"{server.url}/v1/images/generations", json=body)
            assert r.status_code == 500 and re.search(r"error id [0-9a-f]{12}", r.json()["error"]["message"])
            assert (await h.post(f"{server.url}/v1/images/generations", json=body)).status_code == 200
            live = (await h.get(f"{server.url}/health/live")).json()
        assert live["faults"]["image"] == 1
    finally:
        errors.arm("image job", 0)
        server.stop.set()


async def test_two_requests_at_once_are_run_in_turn(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    events = server.system.subscribe()
    try:
        results: list[int] = []

        async def one(prompt: str) -> None:
            async with httpx.AsyncClient(timeout=120) as h:
                r = await h.post(f"{server.url}/v1/images/generations",
                                 json={"model": MODEL, "prompt": prompt, "size": "64x64", "steps": 3})  # fmt: skip
                results.append(r.status_code)

        async with trio.open_nursery() as both:
            both.start_soon(one, "first")
            both.start_soon(one, "second")
        assert results == [200, 200]
        order = []
        while len(order) < 4:
            event = events.receive_nowait()
            if isinstance(event, (ImageJobBegan, ImageJobEnded)):
                order.append(type(event).__name__)
        assert order == ["ImageJobBegan", "ImageJobEnded", "ImageJobBegan", "ImageJobEnded"]
    finally:
        server.stop.set()


async def test_without_an_image_model_the_routes_say_so(nursery: trio.Nursery) -> None:
    from turbospark.model.backend import BackendSpec
    from turbospark.model.scripted import ScriptedBackend

    backend = ScriptedBackend()
    spec = BackendSpec(backend.model_id, lambda: backend)
    server = await nursery.start(partial(serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), [spec]))
    try:
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{server.url}/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 503 and "no model capable" in r.json()["error"]["message"]
    finally:
        server.stop.set()




def test_serve_image_model_imports_a_pipeline_directory_and_serves_it(pipeline: Path, tmp_path: Path) -> None:
    """``serve --image-model DIR``: imported into the store once, attached at startup (named on
    the startup lines), and served to the openai SDK."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", "--port", "0", "--model", "scripted", "--image-model", str(pipeline)],
        env={**os.environ, "TURBOSPARK_HOME": str(tmp_path)}, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:
            said.append(line)
            if line.startswith("  images:"):
                break
        url = next(m[1] for line in said if (m := re.match(r"turbospark listening on (http://\S+)", line)))
        assert said[-1].split() == ["images:", "tiny-zimage"], said
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert "tiny-zimage" in [m.id for m in sdk.models.list().data]
        done = sdk.images.generate(model="tiny-zimage", prompt="a red fox", size="64x64", extra_body={"steps": 2})
        assert _png(base64.b64decode(done.data[0].b64_json)).size == (64, 64)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
