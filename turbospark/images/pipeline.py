"""A text-to-image pipeline in MLX: Z-Image's text encoder, transformer, VAE and schedule.

``ZImagePipeline`` loads a stored pipeline directory (Diffusers' layout: ``model_index.json``,
``transformer/``, ``text_encoder/``, ``tokenizer/``, ``vae/``, ``scheduler/``) and runs what
Diffusers' ``ZImagePipeline`` and ``ZImageImg2ImgPipeline`` run, step for step:

    captions = encoder(prompt) × n  (and the negative prompt's, under guidance)
    latents  = noise(seed)           (an edit: the image's latents, noised to the first step)
    for each step:                   check() first: a client that left stops the run here
        velocity = -transformer(latents, t, captions)   (guidance: pos + g · (pos - neg))
        latents += (sigma_next - sigma) · velocity
        a preview (the step's estimate of the clean image, decoded) when one is asked for
    image = vae.decode(latents / scaling + shift), to 8-bit RGB as Diffusers' postprocess does

The noise is MLX's (``mx.random.normal`` under the seed), not torch's: the same seed gives the
same image here every time, not the reference's image; tests hand both the same latents.
Nothing here imports Trio: it runs on the model's own thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import RequestInvalid
from .messages import GenerateArgs
from .schedule import Schedule, check_config, preview_steps, schedule_for
from .text_encoder import MAX_SEQUENCE_LENGTH, TextEncoder
from .vae import AutoencoderKL, load_vae
from .widen import widen
from .zimage_dit import ZImageDiT, load_transformer

__all__ = ["GenerateArgs", "ZImagePipeline", "preview_steps", "to_rgb8"]

#: what a request that names no ``steps`` or ``size`` gets: Z-Image-Turbo's model card's example
DEFAULT_STEPS = 9
DEFAULT_SIZE = 1024
#: the pipelines this module runs, by ``model_index.json``'s ``_class_name``
PIPELINES = ("ZImagePipeline", "ZImageImg2ImgPipeline")


def to_rgb8(decoded: mx.array) -> list[np.ndarray]:
    """The VAE's output (``[B, H, W, 3]``, about -1..1) as 8-bit RGB images, as Diffusers'
    ``VaeImageProcessor.postprocess`` makes them: ``round(clip(x / 2 + 0.5, 0, 1) * 255)``."""
    pixels = np.array(mx.clip(decoded.astype(mx.float32) / 2 + 0.5, 0, 1))
    return [np.round(p * 255).astype(np.uint8) for p in pixels]


#: below this many bytes of weights, a pipeline on the CPU is held in float32 (MLX's CPU products are
#: BLAS's in float32 only); above it, in the types it was stored in, to fit in memory, its products
#: still computed in float32 (``widen``).  The VAE (a few hundred MB) is float32 on the CPU always.
FLOAT32_BELOW = 4 << 30


def _dtype_for(directory: Path) -> mx.Dtype | None:
    if mx.default_device() != mx.cpu:
        return None
    size = sum(p.stat().st_size for p in directory.glob("*/*.safetensors"))
    return mx.float32 if size < FLOAT32_BELOW else None


class ZImagePipeline:
    """A loaded Z-Image pipeline.  ``multiple``: what width and height must divide by."""

    task = "text_to_image"

    def __init__(self, directory: Path, model_id: str, dtype: mx.Dtype | None = None) -> None:
        index = json.loads((directory / "model_index.json").read_text())
        dtype = dtype or _dtype_for(directory)
        if index.get("_class_name") not in PIPELINES:
            raise ValueError(f"a {index.get('_class_name')!r} pipeline is not supported (only Z-Image)")
        self.model_id = model_id
        self.scheduler_config: dict[str, Any] = json.loads((directory / "scheduler" / "scheduler_config.json").read_text())
        check_config(self.scheduler_config)
        cpu = mx.default_device() == mx.cpu
        self.transformer: ZImageDiT = load_transformer(directory / "transformer", dtype)
        self.vae: AutoencoderKL = load_vae(directory / "vae", mx.float32 if cpu else dtype)
        self.encoder = TextEncoder(directory / "text_encoder", directory / "tokenizer", dtype)
        if cpu:  # narrow weights stay narrow; their products run in float32 (see widen.py)
            widen(self.transformer)
            widen(self.encoder.model)
        self.patch = int(self.transformer.patch_size)
        self.multiple = self.vae.scale * self.patch
        self.can_edit = True  # the VAE has its encoder: image-to-image
        self.default_steps = DEFAULT_STEPS
        self.default_size = DEFAULT_SIZE
        self.max_prompt_tokens = MAX_SEQUENCE_LENGTH

    def tokens(self, prompt: str) -> int:
        return len(self.encoder.tokens(prompt))

    def generate(
        self,
        args: GenerateArgs,
        check: Callable[[], None],
        preview: Callable[[int, list[np.ndarray]], None] | None = None,
        *,
        latents: mx.array | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[np.ndarray]:
        """Run ``args``; the ``n`` images.  ``check()`` is called before the text encoder, before
        every step and before the decode (it raises to stop the run); ``preview(index, images)``
        hears the partial images; ``progress(done, steps)`` each finished step.  ``latents``
        (``[n, C, h, w]``) replaces the seeded noise (the reference comparisons)."""
        if args.width % self.multiple or args.height % self.multiple:
            raise RequestInvalid(f"width and height must be multiples of {self.multiple} pixels", param="size")
        check()
        caption = self.encoder.encode(args.prompt)
        guided = args.guidance_scale > 0
        negative = self.encoder.encode(args.negative_prompt) if guided else None
        h, w = args.height // self.vae.scale, args.width // self.vae.scale
        schedule = schedule_for(self.scheduler_config, args.steps, (h // self.patch) * (w // self.patch))
        start = 0
        if latents is None:
            latents = mx.random.normal((args.n, self.transformer.in_channels, h, w), key=mx.random.key(args.seed))
        if args.image is not None:
            start, latents = self._noised_image(args, schedule, latents)
        latents = latents.astype(mx.float32)
        captions: list[mx.array] = [caption] * args.n + ([negative] * args.n if negative is not None else [])
        previews = set(preview_steps(args.steps - start, args.partial_images)) if preview is not None else set()
        done = 0
        for i in range(start, args.steps):
            check()
            velocity = self._velocity(latents, schedule.model_time(i), captions, args.guidance_scale)
            if i - start in previews:
                estimate = latents - float(schedule.sigmas[i]) * velocity
                assert preview is not None
                preview(sorted(previews).index(i - start), self._decode(estimate))
            latents = latents + schedule.dt(i) * velocity
            mx.eval(latents)
            done += 1
            if progress is not None:
                progress(done, args.steps - start)
        check()
        return self._decode(latents)

    def _velocity(self, latents: mx.array, time: float, captions: Sequence[mx.array], guidance: float) -> mx.array:
        n = latents.shape[0]
        if guidance > 0:
            out = self.transformer(mx.concatenate([latents, latents]), mx.full((2 * n,), time), captions)
            pos, neg = out[:n].astype(mx.float32), out[n:].astype(mx.float32)
            return -(pos + guidance * (pos - neg))
        return -self.transformer(latents, mx.full((n,), time), captions).astype(mx.float32)

    def _decode(self, latents: mx.array) -> list[np.ndarray]:
        z = latents / self.vae.scaling_factor + self.vae.shift_factor
        return to_rgb8(self.vae.decode(z.transpose(0, 2, 3, 1)))

    def _noised_image(self, args: GenerateArgs, schedule: Schedule, noise: mx.array) -> tuple[int, mx.array]:
        """ZImageImg2ImgPipeline's start: the first ``steps - steps·strength`` steps skipped,
        the image's latents (sampled from the VAE's posterior) mixed with the noise at the
        first kept step's sigma."""
        assert args.image is not None
        keep = min(args.steps * args.strength, args.steps)
        start = int(max(args.steps - keep, 0))
        if start >= args.steps:
            raise RequestInvalid("'strength' is too small for this many steps: no step would run", param="strength")
        pixels = mx.array(args.image.astype(np.float32) / 127.5 - 1.0)[None]
        mean, logvar = self.vae.encode(pixels)
        eps = mx.random.normal(mean.shape, key=mx.random.key(args.seed + 1))
        sample = mean + mx.exp(0.5 * logvar) * eps
        image_latents = ((sample - self.vae.shift_factor) * self.vae.scaling_factor).transpose(0, 3, 1, 2)
        sigma = float(schedule.sigmas[start])
        return start, sigma * noise + (1.0 - sigma) * mx.broadcast_to(image_latents, noise.shape)
