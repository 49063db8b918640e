"""``GET /openapi.json``: the OpenAPI 3.1 document, generated from the wire types."""

from __future__ import annotations

from quart import Blueprint, Response

from ..web.openapi import document
from ..web.app import json_response

blueprint = Blueprint("openapi_doc", __name__)

_cached: dict[str, object] = {}


@blueprint.get("/openapi.json")
async def openapi_json() -> Response:
    if "doc" not in _cached:
        _cached["doc"] = document()
    return json_response(_cached["doc"])
