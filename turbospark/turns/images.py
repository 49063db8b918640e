"""A request's images for a vision model, shared by every API family (sans-io).

Each family names its image parts its own way (OpenAI's ``image_url`` and Responses'
``input_image`` data URLs, Anthropic's ``image`` blocks with a base64 source, Ollama's base64
``images``); all of them arrive here as data URLs (``turns.structured.check_images`` has
checked their form and count).  ``image_bytes`` decodes one and checks it is an image this
server reads, within the limits, from its header (``checked``: cheap, on the request's task);
``decode_whole`` then decodes every pixel in a worker thread before the job is queued, so a
truncated or corrupt file is refused too.  Every refusal is a 400 naming the part.
``with_images`` turns a message's content into the list of parts a vision model's template
reads, each image part holding its file and where it was (``where``, for those refusals).

``decoded`` is also how the Images API reads an upload (``images.wire.decode_upload``): every
image a client sends is opened, counted and decoded the same way.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import RequestInvalid

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "IMAGE_FORMATS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "checked", "decode_whole", "decoded", "image_bytes",
    "image_parts", "opened", "openai_parts", "with_images",
]  # fmt: skip

#: One image's file, at most (OpenAI's limit is 20 MB a image).
MAX_IMAGE_BYTES = 20 << 20
#: One image's pixels, at most (a 8K photo is 33 million); processors shrink them anyway.
MAX_IMAGE_PIXELS = 50_000_000
#: The formats a client's image may be in.  Any other is refused from its header, before its
#: decoder runs: every image is decoded whole here, and some of PIL's decoders run other programs
#: (EPS runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_NAMED = ", ".join(sorted(IMAGE_FORMATS))
#: PIL's names for them: MPO is a camera's JPEG that holds further pictures after the first
_READ = {*IMAGE_FORMATS, "MPO"}
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")  # PIL's DecompressionBombError: "Image size (N pixels) ..."


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
    """``data`` if it is an image this server reads, within the limits, from its header alone:
    cheap enough for the request's own task.  Its pixels are decoded in a worker thread before
    the job is queued (``decode_whole``), then by the model's processor."""
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestInvalid(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param="messages")
    opened(data, where, "messages", MAX_IMAGE_PIXELS)
    return data


def decode_whole(messages: Iterable[Mapping[str, Any]]) -> None:
    """Every image part of ``messages`` (``with_images``'s, their files fetched) decoded whole:
    a 400 naming the first that does not decode.  Seconds for the largest images: for a worker
    thread (``routes._generation``), never the request's own task.  The pixels are thrown away,
    so a JPEG is decoded at an eighth of its scale: the check needs no more."""
    for m in messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            if isinstance(part, Mapping) and part.get("type") == "image" and "data" in part:
                decoded(part["data"], part.get("where", "messages"), "messages", MAX_IMAGE_PIXELS, reduced=True)


def opened(data: bytes, where: str, param: str, max_pixels: int) -> Image.Image:
    """``data`` as PIL's image, opened (its header read, no pixel decoded); a 400 that begins with
    ``where`` and names ``param`` when it is not an image in ``IMAGE_FORMATS`` or has over
    ``max_pixels`` pixels.

    ``Image.open`` reads the header alone, so the pixels are counted before any is decoded: a
    decompression bomb (a small file that declares a huge image) is refused as too large, not
    decoded.  PIL's own guard, which warns past ``Image.MAX_IMAGE_PIXELS`` (89 million) and
    refuses past twice that, fires while opening, above every limit here; its refusal is read as
    too large too.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning, where warnings are errors
        counted = _BOMB_PIXELS.search(str(exc))
        raise _too_large(where, param, max_pixels, f"{int(counted.group(1)):,} pixels" if counted else "") from None
    except UnidentifiedImageError:
        raise RequestInvalid(f"{where}: the data is not an image this server reads ({_NAMED})", param=param) from None
    except (OSError, ValueError, EOFError, SyntaxError) as exc:  # its format known, its header broken
        raise _undecodable(where, param, exc) from None
    if image.format not in _READ:
        raise RequestInvalid(f"{where}: {image.format} images are not read here ({_NAMED})", param=param)
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large(where, param, max_pixels, f"{width}x{height} pixels, {width * height:,} in all")
    return image


def decoded(data: bytes, where: str, param: str, max_pixels: int, *, reduced: bool = False) -> Image.Image:
    """``data`` as PIL's image (``opened``: the same 400s), decoded whole: ``load()`` decodes
    every pixel, so a file cut short (a PNG's header and no image data, half a JPEG) is refused as
    truncated or corrupt rather than served as whatever the decoder had, which is what PIL's
    ``ImageFile.LOAD_TRUNCATED_IMAGES`` would do; it is never set.

    ``reduced``, for a check whose pixels are thrown away, decodes a JPEG at an eighth of its
    scale: every byte of its stream is still read, so a truncated or corrupt one is found as
    surely, at a fifth of the work.
    """
    from PIL import Image

    image = opened(data, where, param, max_pixels)
    try:
        if reduced and image.format in ("JPEG", "MPO"):
            image.draft(None, (1, 1))  # the smallest scale libjpeg decodes at: an eighth
        image.load()
    except Image.DecompressionBombError:  # PIL's guard, on a size a decoder found past the header
        raise _too_large(where, param, max_pixels, "") from None
    except (OSError, ValueError, EOFError, SyntaxError) as exc:
        raise _undecodable(where, param, exc) from None
    return image


def _too_large(where: str, param: str, max_pixels: int, pixels: str) -> RequestInvalid:
    if not pixels:  # PIL refused it without saying how many
        return RequestInvalid(f"{where}: the image is too large: over the {max_pixels:,} pixels an image may have",
                              param=param)  # fmt: skip
    return RequestInvalid(f"{where}: the image is too large: {pixels}, over the {max_pixels:,} an image may have",
                          param=param)  # fmt: skip


def _undecodable(where: str, param: str, exc: Exception) -> RequestInvalid:
    return RequestInvalid(f"{where}: the image could not be decoded; the file is truncated or corrupt "
                          f"({str(exc) or type(exc).__name__})", param=param)  # fmt: skip


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
            out.append({"type": "image", "data": image_bytes(value, at), "where": at})
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
