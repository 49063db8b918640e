"""``GET /health``: never authenticated, never waits on an actor."""

from __future__ import annotations

from quart import Blueprint, Response

from ..web.app import json_response, system

blueprint = Blueprint("health", __name__)


@blueprint.get("/health")
async def health() -> Response:
    state = "ready" if system().registry.entries else "empty"
    return json_response({"status": "ok", "state": state})
