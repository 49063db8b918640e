"""Ollama's ``POST /api/create``: a model derived from a stored one (``store/derive.py``).

The body is Ollama's: ``model``, ``from``, ``system``, ``template``, ``parameters``, ``license``
(a string or a list), ``messages``, ``stream`` (default true); the older ``modelfile`` text is
read as a Modelfile.  ``files``, ``adapters`` and ``quantize`` (a model made from uploaded blobs,
a LoRA adapter, re-quantization) are refused: the store makes models from files with ``models
import``.  The model is made (hard links to the base's weights, its own small files) before the
answer starts; streamed, the answer is Ollama's status lines, ending with ``success``.  A base
that is not in the store is a 404 and the store is unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, request

from ..errors import NotFound, RequestInvalid
from ..web.app import json_response, system
from ..wire.codec import parse_json
from ..wire.modelfile import ModelfileError, ModelSpec, parameter_value, parse
from ..wire.ollama import ndjson
from ._ollama import named, ndjson_response, shelf

blueprint = Blueprint("ollama_create", __name__)

_REFUSED = {
    "files": "creating a model from uploaded files is not supported: import it with `turbospark models import`",
    "adapters": "ADAPTER is not supported: the store keeps no LoRA adapters",
    "quantize": "quantize is not supported: import the model with `turbospark models import --dtype`",
}


def _spec(body: dict[str, Any]) -> ModelSpec:
    """The ``ModelSpec`` a create body describes; a 400 naming the field that is wrong."""
    for field, why in _REFUSED.items():
        if body.get(field):
            raise RequestInvalid(why, param=field)
    if isinstance(body.get("modelfile"), str) and not body.get("from"):
        try:
            return parse(body["modelfile"])
        except ModelfileError as exc:
            raise RequestInvalid(str(exc), param="modelfile") from None
    base = body.get("from")
    if not isinstance(base, str) or not base:
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
        base=base, system=body.get("system"), template=body.get("template"), parameters=parameters,
        licenses=tuple(licenses), messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
    )


@blueprint.post("/api/create")
async def create() -> Response:
    sys_ = system()
    body = parse_json(await request.get_data())
    name = named(body).removesuffix(":latest")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestInvalid("stream must be true or false", param="stream")
    spec = _spec(body)
    store = shelf()
    try:
        base_digest = await trio.to_thread.run_sync(store.create, name, spec)
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
