"""What the Ollama routes share: the NDJSON streamed body, the model a management request
names, and the model store they manage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from quart import Response

from ..errors import RequestInvalid
from ..web.app import system
from ._openai import stream_response

__all__ = ["NDJSON", "named", "ndjson_response", "shelf"]

NDJSON = "application/x-ndjson"


def ndjson_response(frames: AsyncIterator[bytes]) -> Response:
    return stream_response(frames, NDJSON)


def named(body: Any) -> str:
    """The model a management request names (``model``, or the older ``name``)."""
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise RequestInvalid("model is required", param="model")
    return name


def shelf() -> Any:
    """The model store to pull into, copy in or delete from; refused without one."""
    found = system().shelf
    if found is None:
        raise RequestInvalid(
            "this server has no model store to manage (every --model is scripted); start it with "
            "a stored model to pull, copy or delete models"
        )
    return found
