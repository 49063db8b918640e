"""OpenAI's Images API: ``POST /v1/images/generations`` (JSON), ``POST /v1/images/edits``
(multipart: one ``image`` and a ``prompt``), and ``GET /v1/images/files/<name>`` (the images a
``response_format: url`` answer points at).

The order of checks: the body's fields (400 naming the field), then the model (unknown: 404;
not an image model: 400; OpenAI's names, ``dall-e-2``, ``dall-e-3``, ``gpt-image-1``..., reach
the only image model, as an SDK requires a name; a stored model not loaded yet loads, through the
resolver), then the size against the model's multiple, then the edit's image (its pixels counted
from its header before any is decoded, then decoded whole: too large, truncated or corrupt is a
400 naming ``image``).  The job goes to the model's queue (full: the retryable 503 chat answers)
and its reply channel is entered into the request scope: a client that leaves, while the job
waits or runs, stops it before its next denoising step (``turbospark_image_cancellations``).
``stream: true`` sends OpenAI's image events (``image_generation.partial_image`` /
``.completed``; ``image_edit.`` for edits) as SSE, and a comment frame per step (``: step 3/8``)
that SDKs skip and the web page shows.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import numpy as np
import trio
from quart import Blueprint, Response, g, request

from ..errors import NoModel, NotFound, RequestInvalid, ShuttingDown
from ..images.messages import GenerateArgs, ImageFailed, ImageInfo, ImageJob, ImageReply, Images, Preview, Step
from ..images.wire import (
    ImageRequest, b64, check_edit, check_generate, completed_event, decode_upload, encode_image, images_response,
    partial_event, pixels_of, resized, usage,
)  # fmt: skip
from ..actors.images import SubmitImage
from ..messages import RequestRouted
from ..web import sse
from ..web.app import exception_body, json_response, request_scope, system
from ..web.bodies import read_json

__all__ = ["blueprint"]

blueprint = Blueprint("images", __name__)

#: the model names OpenAI's SDKs and examples send; they reach the only image model
OPENAI_IMAGE_NAMES = ("dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5")


async def _model(name: str, stream: bool) -> ImageInfo:
    """The image model ``name`` names, loaded and held by the request."""
    sys_ = system()
    if sys_.images is None:
        raise NoModel()
    fallback = not name or (name in OPENAI_IMAGE_NAMES and sys_.registry.find(name) is None)
    grant = await sys_.lease(None if fallback else name, "text_to_image", exact=not fallback)  # none: 503
    system().emit(RequestRouted(g.record.id, name or None, grant.entry.id, stream))
    info: ImageInfo = grant.entry.image
    return info


async def _submit(info: ImageInfo, kind: str, args: GenerateArgs) -> trio.MemoryReceiveChannel[ImageReply]:
    inbox = system().images
    assert inbox is not None
    send, recv = trio.open_memory_channel[ImageReply](args.steps + args.partial_images + 4)
    request_scope().enter_context(recv)  # the request's end is the job's end
    try:
        await inbox.send(SubmitImage(ImageJob(g.record.id, info.id, kind, args, send)))  # type: ignore[arg-type]
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        send.close()
        raise ShuttingDown() from None
    return recv


def _args(req: ImageRequest, info: ImageInfo, width: int, height: int, image: np.ndarray | None = None) -> GenerateArgs:
    return GenerateArgs(
        prompt=req.prompt, width=width, height=height, n=req.n, steps=req.steps or info.default_steps,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31), guidance_scale=req.guidance_scale or 0.0,
        negative_prompt=req.negative_prompt, partial_images=req.partial_images, image=image, strength=req.strength,
    )  # fmt: skip


def _encoded(req: ImageRequest, images: list[np.ndarray]) -> list[bytes]:
    return [encode_image(rgb, req.output_format, req.output_compression) for rgb in images]


def _item(req: ImageRequest, data: bytes) -> dict[str, str]:
    if req.response_format == "url":
        name = system().image_files.put(data, req.output_format, trio.current_time())
        return {"url": f"{request.host_url.rstrip('/')}/v1/images/files/{name}"}
    return {"b64_json": b64(data)}


async def _answer(req: ImageRequest, info: ImageInfo, kind: str, args: GenerateArgs) -> Response:
    recv = await _submit(info, kind, args)
    headers = {"x-turbospark-seed": str(args.seed)}
    if req.stream:
        response = Response(_events(req, info, kind, args, recv), content_type="text/event-stream", headers=headers)
        response.timeout = None
        return response
    async for reply in recv:
        if isinstance(reply, ImageFailed):
            raise reply.error
        if isinstance(reply, Images):
            encoded = await trio.to_thread.run_sync(_encoded, req, reply.images)
            items = [_item(req, data) for data in encoded]
            used = usage(reply.prompt_tokens, args.n, args.width, args.height, info.patch)
            body = images_response(req, int(time.time()), items, args.width, args.height, used)
            response = json_response(body)
            response.headers.update(headers)
            return response
    raise ShuttingDown()


async def _events(req: ImageRequest, info: ImageInfo, kind: str, args: GenerateArgs,
                  recv: trio.MemoryReceiveChannel[ImageReply]) -> AsyncIterator[bytes]:  # fmt: skip
    event = "image_generation" if kind == "generation" else "image_edit"
    async for reply in recv:
        if isinstance(reply, Step):
            yield sse.comment(f"step {reply.done}/{reply.steps}")
        elif isinstance(reply, Preview):
            data = await trio.to_thread.run_sync(_encoded, req, reply.images[:1])
            yield sse.event(f"{event}.partial_image", partial_event(
                req, event, b64(data[0]), reply.index, int(time.time()), args.width, args.height))  # fmt: skip
        elif isinstance(reply, Images):
            encoded = await trio.to_thread.run_sync(_encoded, req, reply.images)
            used = usage(reply.prompt_tokens, args.n, args.width, args.height, info.patch)
            for data in encoded:
                yield sse.event(f"{event}.completed", completed_event(
                    req, event, b64(data), int(time.time()), args.width, args.height, used))  # fmt: skip
            return
        elif isinstance(reply, ImageFailed):
            yield sse.event("error", exception_body(reply.error, "openai"))
            return
    yield sse.event("error", exception_body(ShuttingDown(), "openai"))


@blueprint.post("/v1/images/generations")
async def generations() -> Response:
    req = check_generate(await read_json())
    info = await _model(req.model, req.stream)
    width, height = pixels_of(req.size, info.multiple, info.default_size)
    return await _answer(req, info, "generation", _args(req, info, width, height))


@blueprint.post("/v1/images/edits")
async def edits() -> Response:
    if (request.mimetype or "").lower() != "multipart/form-data":
        raise RequestInvalid("send the image and the prompt as multipart/form-data")
    form, files = await request.form, await request.files
    parts = [(key, f) for key in files for f in files.getlist(key)]
    for key, _ in parts:
        if key not in ("image", "image[]"):
            raise RequestInvalid(f"the file field '{key}' is not supported (only 'image')", param=key)
    req = check_edit({k: form[k] for k in form})
    if len(parts) != 1:
        raise RequestInvalid("send exactly one image to edit", param="image")
    info = await _model(req.model, req.stream)
    if not info.can_edit:
        raise RequestInvalid(f"model '{info.id}' cannot edit images (image-to-image)", param="model")
    rgb = await trio.to_thread.run_sync(decode_upload, parts[0][1].read())
    if req.size == "auto":  # the image's own size, down to the model's multiple
        m = info.multiple
        width, height = max(m, rgb.shape[1] // m * m), max(m, rgb.shape[0] // m * m)
        pixels_of(f"{width}x{height}", m)
    else:
        width, height = pixels_of(req.size, info.multiple, info.default_size)
    rgb = await trio.to_thread.run_sync(resized, rgb, width, height)
    return await _answer(req, info, "edit", _args(req, info, width, height, rgb))


@blueprint.get("/v1/images/files/<name>")
async def files(name: str) -> Response:
    found = system().image_files.get(name, trio.current_time())
    if found is None:
        raise NotFound("no such image (images are kept for an hour)", param="name")
    data, content_type = found
    return Response(data, content_type=content_type, headers={"Cache-Control": "private, max-age=3600"})

