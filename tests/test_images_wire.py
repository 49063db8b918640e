"""The Images API's wire module (sans-io), tested directly: each field's checks (a 400 naming the
field), multipart's string fields, sizes against a model's multiple, encoded images that decode
to what went in, uploads refused by name (not an image, truncated, a decompression bomb counted
from its header), and the response and stream-event bodies in OpenAI's shape."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from turbospark.errors import RequestInvalid
from turbospark.images.wire import (
    MAX_PIXELS, MAX_UPLOAD_PIXELS, check_edit, check_generate, completed_event, decode_upload, encode_image,
    images_response, partial_event, pixels_of, resized, usage,
)  # fmt: skip


def test_a_bare_prompt_takes_openais_defaults() -> None:
    req = check_generate({"prompt": "a red fox"})
    assert (req.model, req.n, req.size, req.response_format, req.output_format) == ("", 1, "auto", "b64_json", "png")
    assert (req.stream, req.partial_images, req.seed, req.steps, req.strength) == (False, 0, None, None, 0.6)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({}, "prompt", "non-empty"),
        ({"prompt": "  "}, "prompt", "non-empty"),
        ({"prompt": "x" * 32_001}, "prompt", "at most 32000"),
        ({"prompt": 3}, "prompt", "must be a string"),
        ({"prompt": "x", "n": 11}, "n", "between 1 and 10"),
        ({"prompt": "x", "n": True}, "n", "integer"),
        ({"prompt": "x", "n": 1.5}, "n", "integer"),
        ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"prompt": "x", "size": "0x64"}, "size", "multiples"),
        ({"prompt": "x", "response_format": "file"}, "response_format", "'b64_json' or 'url'"),
        ({"prompt": "x", "output_format": "gif"}, "output_format", "png"),
        ({"prompt": "x", "background": "transparent"}, "background", "opaque"),
        ({"prompt": "x", "quality": "ultra"}, "quality", "one of"),
        ({"prompt": "x", "partial_images": 2}, "partial_images", "stream"),
        ({"prompt": "x", "stream": True, "partial_images": 4}, "partial_images", "between 0 and 3"),
        ({"prompt": "x", "steps": 0}, "steps", "between 1 and 100"),
        ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale", "number"),
        ({"prompt": "x", "strength": 0.5}, "strength", "not supported"),  # an edit's field only
        ({"prompt": "x", "mystery": 1}, "mystery", "not supported"),
    ],
)
def test_bad_fields_are_400s_naming_them(body: dict, param: str, needle: str) -> None:
    with pytest.raises(RequestInvalid) as refused:
        check_generate(body)
    assert refused.value.param == param and needle in str(refused.value)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RequestInvalid, match="JSON object"):
        check_generate(["a red fox"])


def test_an_edit_form_reads_numbers_and_booleans_from_strings() -> None:
    req = check_edit({"prompt": "make it blue", "n": "2", "seed": "7", "strength": "0.25", "stream": "true",
                      "partial_images": "1", "steps": "4"})  # fmt: skip
    assert (req.n, req.seed, req.strength, req.stream, req.partial_images, req.steps) == (2, 7, 0.25, True, 1, 4)
    assert check_edit({"prompt": "x", "strength": None}).strength == 0.6  # null: the default
    with pytest.raises(RequestInvalid) as refused:
        check_edit({"prompt": "x", "strength": "lots"})
    assert refused.value.param == "strength"
    with pytest.raises(RequestInvalid) as masked:
        check_edit({"prompt": "x", "mask": "m"})
    assert masked.value.param == "mask"


def test_sizes_against_the_models_multiple() -> None:
    assert pixels_of("auto", 16, 1024) == (1024, 1024)
    assert pixels_of("64x32", 8) == (64, 32) and pixels_of("1536X1024", 16) == (1536, 1024)
    for bad in ("60x64", "8x8"):
        with pytest.raises(RequestInvalid, match="multiples of 16"):
            pixels_of(bad, 16)
    with pytest.raises(RequestInvalid, match=f"over this server's {MAX_PIXELS} pixels"):
        pixels_of("4096x4096", 16)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_encoded_images_decode_to_what_went_in(fmt: str) -> None:
    rgb = np.zeros((16, 24, 3), np.uint8)
    rgb[:, :12] = (200, 40, 10)
    data = encode_image(rgb, fmt)
    back = decode_upload(data)
    assert back.shape == (16, 24, 3)
    error = np.abs(back.astype(int) - rgb.astype(int))
    if fmt == "png":
        assert error.max() == 0
    else:  # lossy at quality 100: chroma subsampling blurs the one sharp edge
        assert error.mean() < 3
    assert Image.open(io.BytesIO(data)).format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
    assert resized(back, 12, 8).shape == (8, 12, 3) and resized(back, 24, 16) is back


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def _declaring(width: int, height: int) -> bytes:
    """A PNG that is its header alone: it declares ``width`` x ``height`` pixels and holds none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_an_upload_that_is_not_an_image_is_a_400_naming_the_field() -> None:
    with pytest.raises(RequestInvalid) as refused:
        decode_upload(b"GIF89a but not really", param="image")
    assert refused.value.param == "image"
    assert str(refused.value).startswith("'image': the data is not an image this server reads (BMP, GIF, JPEG")
    with pytest.raises(RequestInvalid, match="'image': ICO images are not read here"):
        decode_upload(_encoded(Image.new("RGB", (16, 16)), "ICO"))


_NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
_PNG, _JPEG = _encoded(_NOISE, "PNG"), _encoded(_NOISE, "JPEG")


@pytest.mark.parametrize(
    "data",
    [_PNG[:60], _PNG[: len(_PNG) // 2], _declaring(64, 48), _JPEG[: len(_JPEG) // 2], _JPEG[:-2]],
    ids=["png-header-and-a-scrap", "png-half", "png-without-idat", "jpeg-half", "jpeg-without-eoi"],
)
def test_a_truncated_upload_is_a_400_saying_it_could_not_be_decoded(data: bytes) -> None:
    """Each opens (its header is whole, its size known) and fails only once its pixels are
    decoded: that is done before the upload is taken, and the refusal says what is wrong."""
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (64, 48)
    with pytest.raises(RequestInvalid) as refused:
        decode_upload(data, param="image")
    assert refused.value.param == "image"
    assert str(refused.value).startswith("'image': the image could not be decoded; the file is truncated or corrupt")


def test_a_decompression_bomb_is_refused_as_too_large_from_its_header_before_any_decoding() -> None:
    # a header alone, 6000x6000: were it decoded first, it would be refused as truncated
    with pytest.raises(RequestInvalid) as refused:
        decode_upload(_declaring(6000, 6000), param="image")
    assert refused.value.param == "image"
    assert str(refused.value) == ("'image': the image is too large: 6000x6000 pixels, 36,000,000 in all, "
                                  f"over the {MAX_UPLOAD_PIXELS:,} an image may have")  # fmt: skip
    # a real one: 36 million 1-bit pixels in a few kilobytes
    bomb = _encoded(Image.new("1", (6000, 6000)), "PNG")
    assert len(bomb) < 10_000
    with pytest.raises(RequestInvalid, match=r"'image': the image is too large: 6000x6000 pixels"):
        decode_upload(bomb)
    # past PIL's own guard (twice Image.MAX_IMAGE_PIXELS), which refuses it while opening: too large still
    assert 20_000 * 20_000 > 2 * (Image.MAX_IMAGE_PIXELS or 0)
    with pytest.raises(RequestInvalid) as refused:
        decode_upload(_declaring(20_000, 20_000), param="image")
    assert refused.value.param == "image"
    assert str(refused.value).startswith("'image': the image is too large: 400,000,000 pixels, over the")


def test_an_upload_within_the_limits_decodes_to_its_pixels() -> None:
    rgb = decode_upload(_PNG)
    assert rgb.shape == (48, 64, 3) and (rgb == np.asarray(Image.open(io.BytesIO(_PNG)))).all()
    assert decode_upload(_encoded(Image.new("L", (4096, 4096)), "PNG")).shape == (4096, 4096, 3)  # the limit itself
    mpo = io.BytesIO()  # a camera's JPEG holding a second picture, which PIL names MPO
    _NOISE.save(mpo, "MPO", save_all=True, append_images=[_NOISE])
    assert Image.open(mpo).format == "MPO" and decode_upload(mpo.getvalue()).shape == (48, 64, 3)


def test_bodies_have_openais_shape() -> None:
    req = check_generate({"prompt": "x", "stream": True, "output_format": "webp"})
    used = usage(7, 2, 64, 32, 16)
    assert used["output_tokens"] == 2 * 4 * 2 and used["total_tokens"] == 7 + 16
    body = images_response(req, 1, [{"b64_json": "AA=="}], 64, 32, used)
    assert body["size"] == "64x32" and body["output_format"] == "webp" and body["data"] == [{"b64_json": "AA=="}]
    part = partial_event(req, "image_generation", "AA==", 1, 5, 64, 32)
    assert part["type"] == "image_generation.partial_image" and part["partial_image_index"] == 1
    done = completed_event(req, "image_edit", "AA==", 5, 64, 32, used)
    assert done["type"] == "image_edit.completed" and done["usage"] == used and done["background"] == "opaque"
