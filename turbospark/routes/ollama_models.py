"""Ollama's model management routes: ``HEAD``/``GET /`` (liveness), ``/api/version``,
``/api/tags`` (stored models), ``/api/show`` (one model's details), ``/api/ps`` (loaded models),
``/api/delete`` and ``/api/copy`` (the model store); ``/api/create`` is ``ollama_create``.
``/api/show`` prints the Modelfile that makes a model (a derived model's settings, an imported
Ollama model's system prompt and parameters) and its licence.

Every kind of stored model is listed (chat, completion, embedding, speech-to-text,
text-to-speech), with what its files say (``store/card.py``): ``details`` (format, family,
parameter size, quantization), and in ``/api/show`` ``model_info`` (``general.architecture``,
``general.parameter_count``, ``<arch>.context_length``, ...) and ``capabilities``
(``completion``, ``tools``, ``thinking``, ``embedding``, or the audio task).

Models are named exactly (``name`` or ``name:latest``): an unknown one is a 404, never another
model.  Pinned models (named with ``--model``, ``--embedding-model``, ``--stt-model`` or
``--tts-model``) cannot be deleted.  A model still answering requests is asked to unload and the
delete waits until it has (its files are never removed under a request reading them), up to
``DELETE_WAIT``: beyond, a 409 ``model_in_use`` and nothing deleted.
"""

from __future__ import annotations

import time
from typing import Any

import trio
from quart import Blueprint, Response, request

from .. import __version__
from ..actors.lifecycle import Loadable
from ..actors.registry import ModelEntry
from ..errors import ModelInUse, ModelNotFound, RequestInvalid
from ..messages import ModelUnloaded
from ..web.app import json_response, system
from ..web.page import wants_page
from ..web.bodies import read_json
from ..wire.ollama import rfc3339
from . import page
from ._ollama import named, shelf
from .models import capabilities, loadable_of

blueprint = Blueprint("ollama_models", __name__)

#: ``expires_at`` of a model kept forever
NEVER = "2318-08-02T00:00:00Z"
_FLAGS = {"embedding": "--embedding-model", "speech-to-text": "--stt-model", "text-to-speech": "--tts-model"}


def _details(loadable: Loadable | None, entry: ModelEntry) -> dict[str, Any]:
    card = loadable.card if loadable is not None else None
    family = card.family if card is not None else ""
    return {
        "parent_model": "",
        "format": card.format if card is not None else "",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": card.parameter_size if card is not None else "",
        "quantization_level": card.quantization_level if card is not None else "",
    }


def _model_info(entry: ModelEntry, loadable: Loadable | None) -> dict[str, Any]:
    """Ollama's ``model_info``: what the card read from the files, else what the entry knows."""
    if loadable is not None and loadable.card.model_info:
        return dict(loadable.card.model_info)
    arch = (loadable.card.family if loadable is not None else "") or "turbospark"
    info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": entry.context_window}
    if entry.dimensions:
        info[f"{arch}.embedding_length"] = entry.dimensions
    return info


def _tag_row(entry: ModelEntry, name: str | None = None) -> dict[str, Any]:
    """``entry``'s row in ``/api/tags`` (as ``name``: one of its LoRA adapters)."""
    loadable = loadable_of(entry)
    card = loadable.card if loadable is not None else None
    return {
        "name": name or entry.id,
        "model": name or entry.id,
        "modified_at": rfc3339(card.modified_at if card and card.modified_at else entry.created or time.time()),
        "size": loadable.size if loadable is not None else 0,
        "digest": card.digest if card else "",
        "details": _details(loadable, entry),
    }


async def _entry(name: str) -> ModelEntry:
    registry = await system().refresh()
    entry = registry.find(name)
    if entry is None:
        raise ModelNotFound(name, [])
    return entry


@blueprint.route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    if wants_page(request.method, request.headers.get("accept")):
        return page.index()  # a browser: the web page
    return Response("Ollama is running", content_type="text/plain; charset=utf-8")


@blueprint.get("/api/version")
async def version() -> Response:
    return json_response({"version": __version__})


@blueprint.get("/api/tags")
async def tags() -> Response:
    registry = await system().refresh()
    rows = [_tag_row(e, name) for e in registry.entries for name in (None, *e.adapters)]
    return json_response({"models": rows})


@blueprint.post("/api/show")
async def show() -> Response:
    entry = await _entry(named(await read_json()))
    loadable = loadable_of(entry)
    card = loadable.card if loadable is not None else None
    store = system().shelf
    modelfile_of = getattr(store, "modelfile", None)
    written = await trio.to_thread.run_sync(modelfile_of, entry.id) if modelfile_of is not None else None
    modelfile, licence = written or (f"# Modelfile generated by turbospark\nFROM {entry.id}\n", "")
    details = _details(loadable, entry)
    if (parent := _parent(modelfile, entry.id)) is not None:
        details["parent_model"] = parent
    return json_response({
        "license": licence,
        "modelfile": modelfile,
        "parameters": card.parameters if card else "",
        "template": card.template if card else "",
        "details": details,
        "model_info": _model_info(entry, loadable),
        "capabilities": capabilities(entry, loadable),
        "modified_at": _tag_row(entry)["modified_at"],
    })


def _parent(modelfile: str, name: str) -> str | None:
    """The base a Modelfile names, when it is another model (a derived one's)."""
    base = next((line[5:].strip() for line in modelfile.splitlines() if line.startswith("FROM ")), None)
    return base if base and base != name else None


@blueprint.get("/api/ps")
async def ps() -> Response:
    rows = []
    for model in await system().running():
        rows.append(_tag_row(model.entry) | {
            "expires_at": NEVER if model.expires is None else rfc3339(model.expires),
            "size_vram": 0,  # MLX on CPU here: the weights are in ordinary memory
            "context_length": model.entry.context_window,
        })
    return json_response({"models": rows})


#: how long a delete waits for the requests a model is answering to end (it unloads then)
DELETE_WAIT = 30.0


async def _unloaded(model_id: str) -> bool:
    """Ask ``model_id`` to unload (at once when idle, else once its requests end) and wait until
    it has, up to ``DELETE_WAIT``: its files are not removed under a request that reads them."""
    sys_ = system()
    with sys_.subscribe() as events:  # before the unload, so its event cannot be missed
        await sys_.unload(model_id)
        if model_id not in {m.entry.id for m in await sys_.running()}:
            return True
        with trio.move_on_after(DELETE_WAIT):
            async for event in events:
                if isinstance(event, ModelUnloaded) and event.model == model_id:
                    return True
        # the event stream may have fallen behind (and been closed): the registry decides
        return model_id not in {m.entry.id for m in await sys_.running()}


@blueprint.route("/api/delete", methods=["DELETE"])
async def delete() -> Response:
    sys_ = system()
    name = named(await read_json())
    store = shelf()
    entry = await _entry(name)
    loadable = loadable_of(entry)
    if loadable is None or loadable.pinned:
        flag = _FLAGS.get(loadable.kind if loadable is not None else "", "--model")
        raise RequestInvalid(f"'{entry.id}' was named with {flag} when the server started; it cannot be deleted while it runs")
    if not await _unloaded(entry.id):
        raise ModelInUse(entry.id, DELETE_WAIT)
    if not await trio.to_thread.run_sync(store.delete, entry.id):
        raise ModelNotFound(name, [])
    await sys_.refresh()
    return Response("", status=200)


@blueprint.post("/api/copy")
async def copy() -> Response:
    sys_ = system()
    body = await read_json()
    if not isinstance(body, dict) or not isinstance(body.get("source"), str) or not isinstance(body.get("destination"), str):
        raise RequestInvalid("source and destination are required model names")
    store = shelf()
    source = (await _entry(body["source"])).id
    try:
        copied = await trio.to_thread.run_sync(store.copy, source, body["destination"].removesuffix(":latest"))
    except Exception as exc:  # an invalid destination name
        raise RequestInvalid(str(exc), param="destination") from None
    if not copied:
        raise ModelNotFound(body["source"], [])
    await sys_.refresh()
    return Response("", status=200)
