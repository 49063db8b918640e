"""A request's images for a vision model, shared by every API family (sans-io).

Each family names its image parts its own way (OpenAI's ``image_url`` and Responses'
``input_image`` data URLs, Anthropic's ``image`` blocks with a base64 source, Ollama's base64
``images``); all of them arrive here as data URLs (``turns.structured.check_images`` has
checked their form and count).  ``image_bytes`` decodes one and checks it is an image this
server reads, within the limits, from its header alone (the pixels are decoded on the model
thread); every refusal is a 400 naming the part.  ``with_images`` turns a message's content into
the list of parts a vision model's template reads, each image part holding its file.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import RequestInvalid

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "checked", "image_bytes", "image_parts", "openai_parts", "with_images"]

#: One image's file, at most (OpenAI's limit is 20 MB a image).
MAX_IMAGE_BYTES = 20 << 20
#: One image's pixels, at most (a 8K photo is 33 million); processors shrink them anyway.
MAX_IMAGE_PIXELS = 50_000_000
_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}


def image_bytes(url: str, where: str) -> bytes:
    """The file a data URL carries, checked to be an image within the limits."""
    payload = url[url.find(",") + 1:]
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RequestInvalid(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param="messages")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestInvalid(f"{where}: the image is not valid base64", param="messages") from None
    return checked(data, where)


def checked(data: bytes, where: str) -> bytes:
    """``data`` if it is an image this server reads, within the limits (from its header alone)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise RequestInvalid(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param="messages")

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise RequestInvalid(f"{where}: the data is not an image this server reads "
                             f"({', '.join(sorted(_FORMATS))})", param="messages") from None
    if kind not in _FORMATS:
        raise RequestInvalid(f"{where}: {kind} images are not read here ({', '.join(sorted(_FORMATS))})",
                             param="messages")
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestInvalid(f"{where}: the image has {width}x{height} pixels, over the "
                             f"{MAX_IMAGE_PIXELS // 1_000_000} million pixels an image may have", param="messages")
    return data


def with_images(parts: Iterable[tuple[str, Any]], where: str) -> list[dict[str, Any]]:
    """A content as a vision template reads it: ``parts`` are ``("text", str)`` or ``("image",
    URL)`` in order; an image part keeps its file (``data``), which templates never read, or
    for an http(s) URL (``--image-urls``) the ``url`` the route fetches (``routes/_images.py``)."""
    out: list[dict[str, Any]] = []
    for kind, value in parts:
        at = f"{where} image {sum(p['type'] == 'image' for p in out) + 1}"
        if kind == "image" and isinstance(value, str) and value[:8].lower().startswith(("http://", "https://")):
            out.append({"type": "image", "url": value, "where": at})
        elif kind == "image":
            out.append({"type": "image", "data": image_bytes(value, at)})
        elif value:
            out.append({"type": "text", "text": value})
    return out


def image_parts(messages: Iterable[Mapping[str, Any]]) -> int:
    """How many image parts ``messages`` keep (fetched or not)."""
    return sum(isinstance(p, Mapping) and p.get("type") == "image"
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def openai_parts(content: Iterable[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """OpenAI's (and Responses') content parts as ``with_images`` reads them."""
    out: list[tuple[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            out.append(("text", part["text"]))
        elif kind == "image_url":
            image = part.get("image_url")
            out.append(("image", image.get("url") if isinstance(image, Mapping) else image))
        elif kind == "input_image":
            out.append(("image", part.get("image_url")))
    return out
