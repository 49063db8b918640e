"""The web page's files and who may fetch them (sans-io apart from reading the package's files).

The page is plain ES modules and CSS in ``web/static`` (no build step), served at ``/`` to
browsers (a ``GET`` whose ``Accept`` names ``text/html``; ``HEAD /`` and other clients keep
Ollama's plain answer) and under ``/ui/``.  The page and its files hold nothing secret, so they
pass without the API key (the page asks for the key and sends it on every API call); they pass
the same ``Origin`` and ``Host`` checks as every route.  The Content-Security-Policy lets the
page reach this server only.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path

__all__ = ["CSP", "STATIC", "asset", "is_page", "subprotocol_key", "wants_page"]

STATIC = Path(__file__).parent / "static"

CSP = (
    "default-src 'self'; connect-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
    "script-src 'self'; style-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def wants_page(method: str, accept: str | None) -> bool:
    """A browser asking for ``/``: a GET that accepts HTML."""
    return method == "GET" and "text/html" in (accept or "")


def is_page(method: str, path: str, accept: str | None) -> bool:
    """Whether a request is for the page or its files (public: no API key asked)."""
    if path == "/":
        return wants_page(method, accept)
    return method in ("GET", "HEAD") and path.startswith("/ui/")


@functools.cache
def _files() -> dict[str, Path]:
    """The static files by name: only these are served (no path from a request reaches the disk)."""
    return {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES}


def asset(name: str) -> tuple[bytes, str] | None:
    """A static file's bytes and content type, or None."""
    path = _files().get(name)
    if path is None:
        return None
    return path.read_bytes(), _TYPES[path.suffix]


def subprotocol_key(offered: str | None) -> str:
    """A browser's WebSocket cannot send headers: the page offers its API key as the subprotocol
    ``turbospark-key.<base64url of the key>`` (beside ``turbospark``, the one accepted), as
    OpenAI's Realtime clients offer ``openai-insecure-api-key.<key>`` (beside ``realtime``); ``""``
    when none is offered."""
    for protocol in (offered or "").split(","):
        name, _, value = protocol.strip().partition(".")
        if name == "openai-insecure-api-key" and value:  # OpenAI's Realtime API in a browser
            return value
        if name == "turbospark-key" and value:
            try:
                return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
            except (ValueError, UnicodeDecodeError):
                return ""
    return ""
