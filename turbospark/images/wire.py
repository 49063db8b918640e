"""OpenAI's Images API on the wire (sans-io): the requests' checks, sizes, the encoded images,
and the response and stream-event bodies.

``POST /v1/images/generations`` takes JSON, ``POST /v1/images/edits`` multipart; both become one
``ImageRequest``.  The fields are OpenAI's: ``prompt``, ``n`` (1-10), ``size`` (``auto``, the
named sizes, or any ``WIDTHxHEIGHT`` the model can make: multiples of its patch in pixels, at most
``MAX_PIXELS``), ``response_format`` (``b64_json`` or ``url``), ``output_format`` (``png``,
``jpeg``, ``webp``) with ``output_compression``, ``stream`` with ``partial_images`` (0-3);
``quality``, ``style``, ``moderation``, ``user`` are taken and echoed or ignored, as a local
server does; ``background: transparent`` is refused (the models draw opaque images).  The
extensions are ``seed``, ``steps``, ``negative_prompt``, ``guidance_scale`` and, on edits,
``strength``.  A field nobody knows is a 400 naming it.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ..errors import RequestInvalid
from ..turns.images import decoded

__all__ = [
    "ImageRequest", "MAX_N", "MAX_PIXELS", "MAX_PROMPT_CHARS", "check_edit", "check_generate",
    "completed_event", "decode_upload", "encode_image", "partial_event", "pixels_of",
]  # fmt: skip

MAX_N = 10
MAX_PARTIAL_IMAGES = 3
#: OpenAI's cap for its GPT image models; the model's own token cap is checked on its thread
MAX_PROMPT_CHARS = 32_000
#: the most pixels an image may have (2048 x 2048): a bound on memory, not a model's limit
MAX_PIXELS = 2048 * 2048
MAX_STEPS = 100
#: an uploaded image to edit: at most this many bytes, and ``MAX_UPLOAD_PIXELS`` once decoded
MAX_UPLOAD_BYTES = 25 * 1024 * 1024
MAX_UPLOAD_PIXELS = 4096 * 4096
FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
NAMED_SIZES = ("256x256", "512x512", "1024x1024", "1536x1024", "1024x1536", "1792x1024", "1024x1792")
_QUALITIES = ("auto", "low", "medium", "high", "standard", "hd")
_IGNORED = ("quality", "style", "moderation", "user", "background", "safety_identifier")
_KNOWN = (
    "model", "prompt", "n", "size", "response_format", "output_format", "output_compression", "stream",
    "partial_images", "seed", "steps", "negative_prompt", "guidance_scale", *_IGNORED,
)  # fmt: skip
_EDIT_ONLY = ("strength", "input_fidelity")


@attrs.frozen
class ImageRequest:
    model: str
    prompt: str
    n: int = 1
    size: str = "auto"
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int = 100
    stream: bool = False
    partial_images: int = 0
    seed: int | None = None
    steps: int | None = None
    negative_prompt: str = ""
    guidance_scale: float | None = None
    quality: str = "auto"
    strength: float = 0.6


def _int(body: Mapping[str, Any], key: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # a multipart field
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestInvalid(f"'{key}' must be an integer", param=key)
    if not low <= value <= high:
        raise RequestInvalid(f"'{key}' must be between {low} and {high} (got {value})", param=key)
    return value


def _float(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise RequestInvalid(f"'{key}' must be a number", param=key) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestInvalid(f"'{key}' must be a number", param=key)
    if not low <= value <= high:
        raise RequestInvalid(f"'{key}' must be between {low} and {high} (got {value})", param=key)
    return float(value)


def _str(body: Mapping[str, Any], key: str, default: str) -> str:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise RequestInvalid(f"'{key}' must be a string", param=key)
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in ("true", "false"):  # a multipart field
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise RequestInvalid(f"'{key}' must be a boolean", param=key)
    return value


def _check(body: Mapping[str, Any], known: tuple[str, ...]) -> ImageRequest:
    for key in body:
        if key not in known:
            raise RequestInvalid(f"the field '{key}' is not supported by this server", param=key)
    model = _str(body, "model", "")
    prompt = _str(body, "prompt", "")
    if not prompt.strip():
        raise RequestInvalid("'prompt' must be a non-empty string", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestInvalid(f"'prompt' is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}", param="prompt")
    response_format = _str(body, "response_format", "b64_json")
    if response_format not in ("b64_json", "url"):
        raise RequestInvalid("'response_format' must be 'b64_json' or 'url'", param="response_format")
    output_format = _str(body, "output_format", "png")
    if output_format not in FORMATS:
        raise RequestInvalid("'output_format' must be 'png', 'jpeg' or 'webp'", param="output_format")
    if _str(body, "background", "auto") == "transparent":
        raise RequestInvalid("'background': 'transparent' is not supported: the models draw opaque images",
                             param="background")  # fmt: skip
    quality = _str(body, "quality", "auto")
    if quality not in _QUALITIES:
        raise RequestInvalid(f"'quality' must be one of {', '.join(_QUALITIES)}", param="quality")
    stream = _bool(body, "stream")
    partial = _int(body, "partial_images", 0, MAX_PARTIAL_IMAGES, 0) or 0
    if partial and not stream:
        raise RequestInvalid("'partial_images' needs 'stream': true", param="partial_images")
    size = _str(body, "size", "auto")
    pixels_of(size, 1)  # its shape; the model's multiple is checked once the model is known
    return ImageRequest(
        model=model, prompt=prompt, n=_int(body, "n", 1, MAX_N, 1) or 1, size=size,
        response_format=response_format, output_format=output_format,
        output_compression=_int(body, "output_compression", 0, 100, 100) or 0,
        stream=stream, partial_images=partial, seed=_int(body, "seed", 0, 2**63 - 1, None),
        steps=_int(body, "steps", 1, MAX_STEPS, None), negative_prompt=_str(body, "negative_prompt", ""),
        guidance_scale=_float(body, "guidance_scale", 0.0, 30.0), quality=quality,
        strength=_or(_float(body, "strength", 0.0, 1.0), 0.6),
    )  # fmt: skip


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def check_generate(body: Any) -> ImageRequest:
    """A ``/v1/images/generations`` body, checked; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    return _check(body, _KNOWN)


def check_edit(fields: Mapping[str, str]) -> ImageRequest:
    """A ``/v1/images/edits`` form's text fields, checked (the image parts are the route's)."""
    if "mask" in fields:
        raise RequestInvalid("'mask' is not supported: an edit redraws the whole image", param="mask")
    return _check(fields, _KNOWN + _EDIT_ONLY)


def pixels_of(size: str, multiple: int, default: int = 1024) -> tuple[int, int]:
    """``size`` as (width, height): ``auto`` is ``default`` square; otherwise ``WIDTHxHEIGHT``,
    each a multiple of ``multiple``, at most ``MAX_PIXELS`` in all."""
    if size == "auto":
        return default, default
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and 0 < len(p) <= 5 for p in parts):
        raise RequestInvalid(f"'size' must be 'auto' or WIDTHxHEIGHT, e.g. 1024x1024 (got {size!r})", param="size")
    width, height = int(parts[0]), int(parts[1])
    if width < multiple or height < multiple or width % multiple or height % multiple:
        raise RequestInvalid(f"'size' {size}: this model makes widths and heights in multiples of {multiple} pixels",
                             param="size")  # fmt: skip
    if width * height > MAX_PIXELS:
        raise RequestInvalid(f"'size' {size} is over this server's {MAX_PIXELS} pixels", param="size")
    return width, height


def encode_image(rgb: np.ndarray, output_format: str, compression: int = 100) -> bytes:
    """An 8-bit RGB image as PNG, JPEG or WebP bytes (``compression``: 0-100, OpenAI's meaning:
    for JPEG and WebP, 100 is the best quality)."""
    from PIL import Image

    out = io.BytesIO()
    image = Image.fromarray(rgb, "RGB")
    if output_format == "png":
        image.save(out, "PNG")
    else:
        image.save(out, FORMATS[output_format], quality=max(1, compression))
    return out.getvalue()


def decode_upload(data: bytes, param: str = "image") -> np.ndarray:
    """An uploaded image as 8-bit RGB; a 400 naming ``param`` when it is over the limits (its
    bytes, or its pixels as its header counts them, before any is decoded), not an image this
    server reads, or does not decode whole (truncated or corrupt).  Checked as a chat message's
    image is (``turns.images.decoded``)."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise RequestInvalid(f"'{param}' is over {MAX_UPLOAD_BYTES // (1024 * 1024)} MiB", param=param)
    image = decoded(data, f"'{param}'", param, MAX_UPLOAD_PIXELS)
    return np.asarray(image.convert("RGB"))


def resized(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """``rgb`` at ``width`` x ``height`` (Lanczos, as Diffusers' image processor resizes)."""
    from PIL import Image

    if rgb.shape[1] == width and rgb.shape[0] == height:
        return rgb
    return np.asarray(Image.fromarray(rgb, "RGB").resize((width, height), Image.Resampling.LANCZOS))


def _common(req: ImageRequest, width: int, height: int) -> dict[str, Any]:
    return {"background": "opaque", "output_format": req.output_format, "quality": req.quality,
            "size": f"{width}x{height}"}  # fmt: skip


def usage(prompt_tokens: int, n: int, width: int, height: int, patch: int) -> dict[str, Any]:
    """OpenAI's image usage: the prompt's tokens in, one token per latent patch out."""
    out = n * (width // patch) * (height // patch)
    return {
        "input_tokens": prompt_tokens, "output_tokens": out, "total_tokens": prompt_tokens + out,
        "input_tokens_details": {"text_tokens": prompt_tokens, "image_tokens": 0},
    }  # fmt: skip


def images_response(req: ImageRequest, created: int, items: list[dict[str, str]], width: int, height: int,
                    usage_: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {"created": created, "data": items, **_common(req, width, height), "usage": usage_}


def partial_event(req: ImageRequest, kind: str, b64: str, index: int, created: int, width: int, height: int) -> dict[str, Any]:
    """``image_generation.partial_image`` (or ``image_edit.``, ``kind`` says)."""
    return {"type": f"{kind}.partial_image", "b64_json": b64, "created_at": created,
            "partial_image_index": index, **_common(req, width, height)}  # fmt: skip


def completed_event(req: ImageRequest, kind: str, b64: str, created: int, width: int, height: int,
                    usage_: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {"type": f"{kind}.completed", "b64_json": b64, "created_at": created,
            **_common(req, width, height), "usage": usage_}  # fmt: skip


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
