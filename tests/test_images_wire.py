"""The Images API's wire module (sans-io), tested directly: each field's checks (a 400 naming the
field), multipart's string fields, sizes against a model's multiple, encoded images that decode
to what went in, and the response and stream-event bodies in OpenAI's shape."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from turbospark.errors import RequestInvalid
from turbospark.images.wire import (
    MAX_PIXELS, check_edit, check_generate, completed_event, decode_upload, encode_image, images_response,
    partial_event, pixels_of, resized, usage,
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


def test_an_upload_that_is_not_an_image_is_a_400_naming_the_field() -> None:
    with pytest.raises(RequestInvalid) as refused:
        decode_upload(b"GIF89a but not really", param="image")
    assert refused.value.param == "image" and "can decode" in str(refused.value)


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
