"""The web page: ``GET /`` for browsers (``ollama_models.root`` hands it over) and ``/ui/<file>``."""

from __future__ import annotations

from quart import Blueprint, Response

from ..errors import NotFound
from ..web.page import CSP, asset

blueprint = Blueprint("page", __name__)


def _file(name: str) -> Response:
    found = asset(name)
    if found is None:
        raise NotFound(f"no file /ui/{name}")
    body, content_type = found
    response = Response(body, content_type=content_type)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def index() -> Response:
    return _file("index.html")


@blueprint.get("/ui/<name>")
async def ui_file(name: str) -> Response:
    return _file(name)
