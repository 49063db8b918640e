"""``GET /v1/models`` and ``GET /v1/models/{id}``: read the registry only, never resolve, so
they answer even while every resolution slot is taken."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..errors import ModelNotFound
from ..actors.registry import ModelEntry
from ..web.app import json_response, system

blueprint = Blueprint("models", __name__)


def _row(entry: ModelEntry, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "display_name": name,
        "object": "model",
        "created": entry.created,
        "owned_by": "turbospark",
        "context_window": entry.context_window,
    }


@blueprint.get("/v1/models")
@blueprint.get("/models")
async def list_models() -> Response:
    rows = [_row(e, name) for e in system().registry.entries for name in e.names]
    if system().audio is not None:  # audio models follow, with their capabilities
        from ..audio.messages import ListAudio
        from .audio import audio_row
        from ._audio import ask

        rows += [audio_row(info) for info in await ask(ListAudio)]
    return json_response({"object": "list", "data": rows})


@blueprint.get("/v1/models/<path:model_id>")
@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str) -> Response:
    entry = system().registry.lookup(model_id)
    if entry is not None:
        return json_response(_row(entry, model_id))
    if system().audio is not None:  # an audio model, as the list shows it
        from ..audio.messages import ListAudio
        from .audio import audio_row
        from ._audio import ask

        for info in await ask(ListAudio):
            if (row := audio_row(info))["id"] == model_id:
                return json_response(row)
    raise ModelNotFound(model_id, [])
