"""llama.cpp's slots: ``GET /slots`` lists a model's prefix-cache places, ``POST
/slots/{id}?action=save|restore|erase`` (body ``{"filename": ...}`` for the first two) acts on
one (``model/prompt_slots.py``, decision 0022).  ``?model=`` names the model (default: the
server's default).  The route sends a ``SlotCommand`` to the model's thread, which owns the
cache, and answers what it says; errors are llama.cpp's shape (``{"error": {"code", "message",
"type"}}``).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from ..messages import Failed
from ..model.prompt_slots import SlotError
from ..web.app import json_response, system
from ..web.bodies import read_json

blueprint = Blueprint("slots", __name__)


def _error(status: int, kind: str, message: str) -> Response:
    return json_response({"error": {"code": status, "message": message, "type": kind}}, status)


async def _run(action: str, slot: int | None, filename: str | None) -> Response:
    sys_ = system()
    entry = await sys_.resolve(request.args.get("model") or None, "completion")
    answer: Any = await sys_.slots(entry, action, slot, filename)
    if isinstance(answer, SlotError):
        return _error(answer.status, answer.kind, answer.message)
    if isinstance(answer, Failed):
        raise answer.error
    if isinstance(answer, BaseException):
        return _error(500, "server_error", f"slot {action} failed: {answer}")
    return json_response(answer)


@blueprint.get("/slots")
async def slots() -> Response:
    return await _run("list", None, None)


@blueprint.post("/slots/<slot>")
async def slot_action(slot: str) -> Response:
    try:
        index = int(slot)
    except ValueError:
        return _error(400, "invalid_request_error", "Invalid slot ID")
    action = request.args.get("action", "")
    filename = None
    if action in ("save", "restore"):
        body = await read_json()
        filename = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(filename, str):
            return _error(400, "invalid_request_error", "filename is required")
    elif action != "erase":
        return _error(400, "invalid_request_error", "Invalid action")
    return await _run(action, index, filename)
