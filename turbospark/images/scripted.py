"""The scripted image model: deterministic, paced images for client test suites, no weights.

``ScriptedImages`` answers what a pipeline answers (``generate`` with its checks, previews and
progress, ``tokens``, the sizes and defaults), so the routes, the actor, the thread and every
cancellation path run as they do on a real model.  An image is a gradient between two colours
taken from the SHA-256 of the prompt and the seed (the same request, the same pixels; another
seed, another image); an edit blends the uploaded image toward it by ``strength``.  Each step
sleeps ``step_delay`` seconds, so a test can hang up mid-run.  ``serve`` attaches it as
``scripted-image`` when every ``--model`` is scripted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np

from ..errors import RequestInvalid
from .messages import GenerateArgs, ImageSpec
from .schedule import preview_steps

__all__ = ["SCRIPTED_IMAGE_ID", "ScriptedImages", "scripted_image_spec"]

SCRIPTED_IMAGE_ID = "scripted-image"


class ScriptedImages:
    task = "text_to_image"
    multiple = 8
    can_edit = True
    default_steps = 4
    default_size = 256
    max_prompt_tokens = 512

    def __init__(self, model_id: str = SCRIPTED_IMAGE_ID, *, step_delay: float = 0.02) -> None:
        self.model_id = model_id
        self.step_delay = step_delay

    def tokens(self, prompt: str) -> int:
        return len(prompt.split())

    def _image(self, args: GenerateArgs, index: int) -> np.ndarray:
        digest = hashlib.sha256(f"{args.prompt}\0{args.seed}\0{index}".encode()).digest()
        start, end = np.frombuffer(digest[:3], np.uint8), np.frombuffer(digest[3:6], np.uint8)
        ramp = np.linspace(0.0, 1.0, args.width, dtype=np.float32)[None, :, None]
        row = start * (1 - ramp) + end * ramp
        image = np.broadcast_to(row, (args.height, args.width, 3)).astype(np.float32)
        if args.image is not None:
            image = (1 - args.strength) * args.image.astype(np.float32) + args.strength * image
        return np.round(image).astype(np.uint8)

    def generate(
        self,
        args: GenerateArgs,
        check: Callable[[], None],
        preview: Callable[[int, list[np.ndarray]], None] | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[np.ndarray]:
        if args.width % self.multiple or args.height % self.multiple:
            raise RequestInvalid(f"width and height must be multiples of {self.multiple} pixels", param="size")
        steps: int = args.steps
        previews = preview_steps(steps, args.partial_images) if preview is not None else []
        images = [self._image(args, i) for i in range(args.n)]
        check()
        for i in range(steps):
            check()
            time.sleep(self.step_delay)
            if i in previews and preview is not None:
                fraction = (i + 1) / steps
                preview(previews.index(i), [np.round(img * fraction).astype(np.uint8) for img in images])
            if progress is not None:
                progress(i + 1, steps)
        check()
        return images


def scripted_image_spec(step_delay: float = 0.02) -> ImageSpec:
    engine = ScriptedImages(step_delay=step_delay)
    return ImageSpec(engine.model_id, lambda: engine)
