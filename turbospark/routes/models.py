"""``GET /v1/models`` and ``GET /v1/models/{id}``: read the registry, never resolve, so they
answer even while every resolution slot is taken.  The list reads the library (the store) again
first, as ``/api/tags`` does, so a model stored since (a pull from another process) is listed.

Every known model is listed, loaded or not, whatever its kind (chat, completion, embedding,
speech-to-text, text-to-speech, image), each name it answers to on a row of its own.  Besides OpenAI's
``id``, ``object``, ``created`` and ``owned_by``, a row says what the model's files say
(``store/card.py``): ``capabilities`` (``completion``, ``tools``, ``thinking``, ``embedding``,
``speech_to_text``, ``text_to_speech``, ``text_to_image``, ``image_to_image``), ``context_window``, and where known ``architecture``,
``parameters`` (the exact count), ``quantization``; an audio model's row also has its ``task``.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..actors.lifecycle import Loadable
from ..actors.registry import ModelEntry
from ..errors import ModelNotFound
from ..web.app import json_response, system

__all__ = ["blueprint", "capabilities", "loadable_of"]

blueprint = Blueprint("models", __name__)

_AUDIO = ("speech_to_text", "text_to_speech")


def loadable_of(entry: ModelEntry) -> Loadable | None:
    """What the library says of ``entry``'s model (None for a fixed entry)."""
    return system().published.loadables.get(entry.id)


def capabilities(entry: ModelEntry, loadable: Loadable | None) -> list[str]:
    """What the model can do, in Ollama's words (and the audio tasks): its card's, else what
    its registry entry says."""
    if loadable is not None and loadable.card.capabilities:
        return list(loadable.card.capabilities)
    for only in ("embedding", *_AUDIO, "text_to_image"):
        if only in entry.capabilities:
            return [only]
    return ["completion"]


def _row(entry: ModelEntry, name: str) -> dict[str, Any]:
    loadable = loadable_of(entry)
    card = loadable.card if loadable is not None else None
    row: dict[str, Any] = {
        "id": name,
        "display_name": name,
        "object": "model",
        "created": entry.created,
        "owned_by": "turbospark",
        "context_window": entry.context_window,
        "capabilities": capabilities(entry, loadable),
    }
    if card is not None:
        if card.architecture:
            row["architecture"] = card.architecture
        if card.parameter_count:
            row["parameters"] = card.parameter_count
        if card.quantization_level:
            row["quantization"] = card.quantization_level
    task = next((c for c in _AUDIO if c in entry.capabilities), None)
    if task is not None:
        row["task"] = task
    return row


@blueprint.get("/v1/models")
@blueprint.get("/models")
async def list_models() -> Response:
    registry = await system().refresh()
    rows = [_row(e, name) for e in registry.entries for name in e.names]
    return json_response({"object": "list", "data": rows})


@blueprint.get("/v1/models/<path:model_id>")
@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str) -> Response:
    entry = system().registry.lookup(model_id)
    if entry is None:  # stored since the library was last read?
        entry = (await system().refresh()).lookup(model_id)
    if entry is None:
        raise ModelNotFound(model_id, [])
    return json_response(_row(entry, model_id))
