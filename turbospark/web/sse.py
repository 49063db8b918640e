"""Server-sent events framing (sans-io).

Theory of operation: an SSE body is a sequence of frames.  A data frame is ``data: <json>`` and a
blank line; a named frame adds an ``event:`` line first (OpenAI streams name only their error
frame); a comment frame (``: keepalive``) keeps proxies and idle timers from cutting a stream
that is waiting on a long prefill.  Payloads are JSON without newlines, so one ``data:`` line
always suffices.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "KEEPALIVE", "comment", "data", "event"]


def data(payload: Any) -> bytes:
    return b"data: " + _json(payload) + b"\n\n"


def event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json(payload) + b"\n\n"


def comment(text: str) -> bytes:
    return b": " + text.encode() + b"\n\n"


def _json(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


DONE = b"data: [DONE]\n\n"
KEEPALIVE = comment("keepalive")
