"""Ollama's ``POST /api/create`` and ``/api/blobs``: a model derived from a stored one
(``store/derive.py``), made from uploaded files, or imported from Ollama's store.

The body is Ollama's: ``model``, ``from``, ``files``, ``system``, ``template``, ``parameters``,
``license`` (a string or a list), ``messages``, ``stream`` (default true); the older
``modelfile`` text is read as a Modelfile.

- ``from`` a stored model: the model is made (hard links to the base's weights, its own small
  files) before the answer starts; streamed, the answer is Ollama's status lines, ending with
  ``success``.  A base that is not in the store is a 404 and the store is unchanged.
- ``files`` (file name -> digest of a blob uploaded with ``POST /api/blobs/sha256:<hex>``, as
  ``ollama create`` sends a Modelfile's ``FROM ./model.gguf`` or a safetensors directory): the
  files are imported as ``models import`` imports them, converted once into the store, then
  given the body's settings.  Streamed, the import's progress is sent as it goes.
- ``from: "ollama:NAME[:TAG]"``: that model is imported from Ollama's store on this machine
  (``GET /api/ollama/models`` lists it; not Ollama's own route).
``adapters`` (file name -> digest of an uploaded blob: a GGUF LoRA, or an mlx-lm adapter
directory's files, as ``ollama create`` sends a Modelfile's ``ADAPTER``) makes a model that
carries that adapter, applied to every request (decision 0046).  ``quantize`` is refused.  A digest never
uploaded, a file name that is not a plain relative name, or a source that cannot be imported is a
400 (an ``error`` line once a stream has begun), and the store is unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
import trio
from quart import Blueprint, Response, request
from werkzeug.exceptions import RequestTimeout

from ..errors import NotFound, RequestInvalid
from ..web.app import json_response, system
from ..web.bodies import read_json
from ..wire.modelfile import ModelfileError, ModelSpec, parameter_value, parse
from ..wire.ollama import ndjson
from ._ollama import named, ndjson_response, progress_frames, shelf

blueprint = Blueprint("ollama_create", __name__)

OLLAMA = "ollama:"  # a ``from`` that names a model in Ollama's store
_UPLOAD_CHUNK = 1 << 20  # bytes written to a blob per crossing to its worker thread

_REFUSED = {
    "quantize": "quantize is not supported: import the model with `turbospark models import --dtype`",
}


def _spec(body: dict[str, Any], *, base_required: bool = True) -> ModelSpec:
    """The ``ModelSpec`` a create body describes; a 400 naming the field that is wrong."""
    for field, why in _REFUSED.items():
        if body.get(field):
            raise RequestInvalid(why, param=field)
    if isinstance(body.get("modelfile"), str) and not body.get("from"):
        try:
            spec = parse(body["modelfile"])
        except ModelfileError as exc:
            raise RequestInvalid(str(exc), param="modelfile") from None
        if spec.adapter is not None:  # a path on this machine: never read for a request
            raise RequestInvalid("ADAPTER names a file: upload the adapter's files (POST /api/blobs) and name "
                                 "them in adapters", param="modelfile")
        return spec
    base = body.get("from")
    if base_required and (not isinstance(base, str) or not base):
        raise RequestInvalid("from is required: the stored model the new one is made from", param="from")
    for field in ("system", "template"):
        if body.get(field) is not None and not isinstance(body[field], str):
            raise RequestInvalid(f"{field} must be a string", param=field)
    licenses = body.get("license")
    licenses = [licenses] if isinstance(licenses, str) else licenses or []
    if not isinstance(licenses, list) or not all(isinstance(t, str) for t in licenses):
        raise RequestInvalid("license must be a string or a list of strings", param="license")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestInvalid("parameters must be an object", param="parameters")
    try:
        parameters = {str(k).lower(): parameter_value(str(k).lower(), v) for k, v in parameters.items()}
    except ModelfileError as exc:
        raise RequestInvalid(str(exc), param="parameters") from None
    if isinstance(parameters.get("stop"), str):
        parameters["stop"] = [parameters["stop"]]
    messages = body.get("messages") or []
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise RequestInvalid("messages must be a list of {role, content}", param="messages")
    return ModelSpec(
        base=base if isinstance(base, str) else "", system=body.get("system"), template=body.get("template"), parameters=parameters,
        licenses=tuple(licenses), messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
    )


@blueprint.post("/api/create")
async def create() -> Response:
    sys_ = system()
    body = await read_json()
    name = named(body).removesuffix(":latest")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestInvalid("stream must be true or false", param="stream")
    store = shelf()
    if body.get("files") or (isinstance(body.get("from"), str) and body["from"].startswith(OLLAMA)):
        if body.get("adapters"):
            raise RequestInvalid("adapters apply to a stored model: import the model first, then create one "
                                 "from it with the adapters", param="adapters")
        return await _import(sys_, store, name, body, stream)
    spec = _spec(body)
    adapters = body.get("adapters") or None
    if adapters is not None:
        try:  # names and digests, before anything is made
            store.blobs.resolve(adapters)
        except ValueError as exc:
            raise RequestInvalid(str(exc), param="adapters") from None
    try:
        base_digest = await trio.to_thread.run_sync(store.create, name, spec, adapters)
    except LookupError as exc:  # the base is not in the store
        raise NotFound(str(exc), param="from") from None
    except Exception as exc:  # an invalid name, a base of another kind
        raise RequestInvalid(str(exc), param="model") from None
    await sys_.refresh()
    if not stream:
        return json_response({"status": "success"})
    layer = hashlib.sha256(json.dumps([spec.system, spec.template, spec.parameters, spec.messages, spec.licenses],
                                      sort_keys=True).encode()).hexdigest()  # fmt: skip

    async def frames() -> AsyncIterator[bytes]:
        for status in ("gathering model components", f"using existing layer sha256:{base_digest}",
                       f"creating new layer sha256:{layer}", "writing manifest", "success"):  # fmt: skip
            yield ndjson({"status": status})

    return ndjson_response(frames())


async def _import(sys_: Any, store: Any, name: str, body: dict[str, Any], stream: bool) -> Response:
    """A create that imports: from uploaded ``files``, or ``from`` a model in Ollama's store."""
    files, source = body.get("files"), body.get("from")
    spec = _spec(body, base_required=False)
    settings = None if attrs.evolve(spec, base="") == ModelSpec(base="") else spec  # any to apply?
    if files:
        try:  # names and digests before any stream starts (the import checks them again)
            store.blobs.resolve(files)
        except ValueError as exc:
            raise RequestInvalid(str(exc), param="files") from None
        job = partial(store.import_files, name, files, settings)
    else:
        job = partial(store.import_ollama, name, source, settings)
    if stream:
        return ndjson_response(progress_frames(job, done=sys_.refresh, failure="create failed", thread=f"create:{name}"))
    try:
        await trio.to_thread.run_sync(job, lambda *_: None, abandon_on_cancel=True)
    except Exception as exc:  # a source that cannot be imported (the store's ModelImportError)
        raise RequestInvalid(str(exc), param="files" if files else "from") from None
    await sys_.refresh()
    return json_response({"status": "success"})


@blueprint.route("/api/blobs/<digest>", methods=["HEAD"])
async def blob_exists(digest: str) -> Response:
    """Ollama's ``HEAD /api/blobs/sha256:<hex>``: 200 if that blob was uploaded, else 404."""
    try:
        present = shelf().blobs.has(digest)
    except ValueError as exc:
        raise RequestInvalid(str(exc), param="digest") from None
    return Response(b"", status=200 if present else 404)


@blueprint.post("/api/blobs/<digest>")
async def blob_upload(digest: str) -> Response:
    """Ollama's ``POST /api/blobs/sha256:<hex>``: the body is kept under that digest once its
    bytes hash to it (201), else a 400 and nothing kept.  Written on a worker thread a
    mebibyte at a time; a body that pauses longer than the body timeout is a 408."""
    blobs = shelf().blobs
    try:
        upload = await trio.to_thread.run_sync(blobs.upload, digest)
    except ValueError as exc:
        raise RequestInvalid(str(exc), param="digest") from None
    finished = False
    try:
        pending = bytearray()
        chunks = aiter(request.body)
        while True:
            with trio.move_on_after(request.body_timeout or float("inf")) as waited:
                chunk = await anext(chunks, None)
            if waited.cancelled_caught:
                raise RequestTimeout()
            if chunk is not None:
                pending += chunk
            if pending and (chunk is None or len(pending) >= _UPLOAD_CHUNK):
                await trio.to_thread.run_sync(upload.write, bytes(pending))
                pending.clear()
            if chunk is None:
                break
        try:
            await trio.to_thread.run_sync(upload.finish)
        except ValueError as exc:  # the bytes do not hash to the digest
            raise RequestInvalid(str(exc), param="digest") from None
        finished = True
    finally:
        if not finished:  # shielded and bounded: a partial upload is never kept
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await trio.to_thread.run_sync(upload.discard, abandon_on_cancel=True)
    return Response(b"", status=201)


@blueprint.get("/api/ollama/models")
async def ollama_models() -> Response:
    """The models in Ollama's store on this machine, each with why it cannot be imported (or
    ""); what ``from: "ollama:NAME"`` imports.  Not Ollama's; an empty list without a store."""
    store = system().shelf
    models = await trio.to_thread.run_sync(store.ollama_models) if store is not None else []
    return json_response({"models": models})
