"""The web page's Images view in a real headless Chromium (tests/_browser.py), on the scripted
image model: a run shows its steps and partial images, then the image with its seed; Stop ends a
run, which the server counts as a cancelled job stopped mid-run; a bad size is shown as the
server's 400 says it."""

from __future__ import annotations

import base64
import io

import numpy as np
import trio
from PIL import Image

from turbospark.images.messages import ImageJobEnded
from turbospark.images.scripted import ScriptedImages

from ._browser import browse, shot


def _rgb(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))))


async def _ended(events: trio.MemoryReceiveChannel) -> ImageJobEnded:
    with trio.fail_after(30):
        async for event in events:
            if isinstance(event, ImageJobEnded):
                return event
    raise AssertionError("no job ended")


async def test_an_image_is_made_with_its_steps_and_partial_images_then_one_is_stopped(start_server) -> None:
    engine = ScriptedImages(step_delay=0.15)
    server = await start_server(images=[engine])
    events = server.system.subscribe()

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(f"{server.url}/#images")
        page.wait_for_selector("#image-model option[value=scripted-image]", state="attached")
        page.fill("#image-prompt", "a lighthouse at dusk")
        page.fill("#image-size", "64x32")
        page.fill("#image-steps", "6")
        page.fill("#image-seed", "7")
        page.fill("#image-partials-count", "2")
        page.click("#image-generate")
        page.wait_for_selector("#image-state[data-state=running]")
        stop_enabled = page.is_enabled("#image-stop")
        page.wait_for_selector("#image-state[data-state=done]", timeout=30_000)
        done = {
            "partials": page.locator("#image-partials img").count(),
            "progress": page.evaluate("[document.querySelector('#image-progress').value, document.querySelector('#image-progress').max]"),
            "seed": page.get_attribute("#image-result", "data-seed"),
            "caption": page.inner_text("#image-result figcaption"),
            "src": page.get_attribute("#image-result img", "src"),
            "stop_enabled_after": page.is_enabled("#image-stop"),
        }
        shot(page, "images-done")
        page.fill("#image-steps", "60")
        page.click("#image-generate")
        page.wait_for_function("() => document.querySelector('#image-progress').value >= 2")
        page.click("#image-stop")
        page.wait_for_selector("#image-state[data-state=stopped]")
        stopped_at = page.evaluate("document.querySelector('#image-progress').value")
        shot(page, "images-stopped")
        page.fill("#image-size", "65x65")
        page.click("#image-generate")
        page.wait_for_selector("#image-state[data-state=error]")
        error = page.inner_text("#image-state")
        return stop_enabled, done, stopped_at, error

    stop_enabled, done, stopped_at, error = await browse(server.url, drive)
    assert stop_enabled and not done["stop_enabled_after"]
    assert done["partials"] == 2 and done["progress"] == [6, 6]
    assert done["seed"] == "7" and done["caption"].startswith("64x32, seed 7")
    image = _rgb(done["src"])
    assert image.shape == (32, 64, 3)
    from turbospark.images.messages import GenerateArgs

    assert (image == engine._image(GenerateArgs("a lighthouse at dusk", 64, 32, seed=7), 0)).all()

    first = await _ended(events)
    assert (first.outcome, first.steps) == ("done", 6)
    second = await _ended(events)
    assert second.outcome == "cancelled" and second.phase == "running"
    assert stopped_at <= second.steps < 60  # stopped within a step of the page's Stop
    assert "multiples of 8" in error and error.startswith("Error:")
