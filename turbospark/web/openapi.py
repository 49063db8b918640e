"""The OpenAPI 3.1 document, generated from the wire types themselves (sans-io).

Every request body a route structures with the codec is an attrs class in ``wire/`` (or
``audio/wire.py``); its JSON Schema is read from the class's fields and type annotations, so the
document cannot drift from what the server accepts.  ``ROUTES`` names, for each route, its body
type (or its raw body), what a success looks like and its family's error shape; a test checks it
covers every route the app serves, and the fuzzer in the test suite drives every route from it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from .. import __version__

__all__ = ["ROUTES", "Route", "document", "schema_for"]


@attrs.frozen
class Route:
    method: str
    path: str  # OpenAPI style: /v1/models/{model}
    summary: str
    family: Literal["openai", "anthropic", "ollama"] = "openai"
    body: type | None = None  # an attrs wire type, structured by the codec
    raw_body: str | None = None  # a media type the route reads itself (multipart, audio)
    success: str = "application/json"  # or text/event-stream, application/x-ndjson, ...
    streams: tuple[str, ...] = ()  # other success media types (stream: true)
    returns: dict[str, Any] | None = None  # a (loose) schema of the JSON success body
    always: int | None = None  # a route that always answers this status (501: not served)


def _object(*required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": props}


_LIST = _object("object", "data", object={"const": "list"}, data={"type": "array"})
_CHAT = _object("id", "object", "created", "model", "choices", object={"const": "chat.completion"},
                choices={"type": "array"}, usage={"type": "object"})
_TEXT = _object("id", "object", "choices", object={"const": "text_completion"}, choices={"type": "array"})
_RESPONSE = _object("id", "object", "status", "output", object={"const": "response"}, output={"type": "array"})
_MESSAGE = _object("id", "type", "role", "content", "usage", type={"const": "message"}, content={"type": "array"})


def _routes() -> tuple[Route, ...]:
    from ..audio.wire import GenerateRequest, SpeechRequest
    from ..images.wire import ImageRequest
    from ..wire.anthropic import MessagesRequest
    from ..wire.embeddings import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest
    from ..wire.ollama import OllamaChatRequest, OllamaGenerateRequest
    from ..wire.openai import ChatCompletionRequest, CompletionRequest, ResponsesRequest
    from ..wire.rerank import RerankBody, ScoreBody
    from ..wire.tokenize import DetokenizeRequest, TokenizeRequest

    sse = ("text/event-stream",)
    out = [
        Route("get", "/health", "Liveness: {status, state}", returns=_object("status", "state")),
        Route("get", "/health/live", "Liveness probe: the process and its actors run (503 if not)",
              returns=_object("status")),
        Route("get", "/health/ready", "Readiness probe: default models loaded, queues not full, not "
              "draining (503 with reasons if not)", returns=_object("status", "models", "queue")),
        Route("get", "/metrics", "Prometheus metrics", success="text/plain"),
        Route("get", "/v1/metrics", "Prometheus metrics", success="text/plain"),
        Route("get", "/openapi.json", "This document", returns=_object("openapi", "paths")),
        Route("get", "/v1/models", "Every model", returns=_LIST),
        Route("get", "/models", "Every model (base URL without /v1)", returns=_LIST),
        Route("get", "/v1/models/{model_id}", "One model", returns=_object("id", "object")),
        Route("get", "/models/{model_id}", "One model (base URL without /v1)", returns=_object("id", "object")),
        Route("post", "/v1/chat/completions", "OpenAI chat", body=ChatCompletionRequest, streams=sse, returns=_CHAT),
        Route("post", "/chat/completions", "OpenAI chat (base URL without /v1)", body=ChatCompletionRequest, streams=sse, returns=_CHAT),
        Route("post", "/v1/completions", "OpenAI text completion", body=CompletionRequest, streams=sse, returns=_TEXT),
        Route("post", "/completions", "OpenAI text completion (base URL without /v1)", body=CompletionRequest, streams=sse, returns=_TEXT),
        Route("post", "/v1/responses", "OpenAI Responses", body=ResponsesRequest, streams=sse, returns=_RESPONSE),
        Route("post", "/responses", "OpenAI Responses (base URL without /v1)", body=ResponsesRequest, streams=sse, returns=_RESPONSE),
        Route("get", "/v1/responses/{response_id}", "A stored response", returns=_RESPONSE),
        Route("get", "/responses/{response_id}", "A stored response", returns=_RESPONSE),
        Route("delete", "/v1/responses/{response_id}", "Forget a stored response", returns=_object("id", "deleted")),
        Route("delete", "/responses/{response_id}", "Forget a stored response", returns=_object("id", "deleted")),
        Route("post", "/v1/messages", "Anthropic Messages", "anthropic", body=MessagesRequest, streams=sse, returns=_MESSAGE),
        Route("post", "/v1/messages/count_tokens", "Anthropic token count", "anthropic", body=MessagesRequest,
              returns=_object("input_tokens")),
        Route("post", "/v1/embeddings", "OpenAI embeddings", body=EmbeddingRequest, returns=_LIST),
        Route("post", "/embeddings", "OpenAI embeddings (base URL without /v1)", body=EmbeddingRequest, returns=_LIST),
        Route("post", "/api/embed", "Ollama embeddings", "ollama", body=OllamaEmbedRequest, returns=_object("embeddings")),
        Route("post", "/api/embeddings", "Ollama embeddings (older shape)", "ollama", body=OllamaEmbeddingsRequest,
              returns=_object("embedding")),
        Route("post", "/v1/rerank", "Rerank documents against a query (Jina/Cohere; TEI's texts)", body=RerankBody,
              returns=_object("results")),
        Route("post", "/v2/rerank", "Rerank (vLLM's second path)", body=RerankBody, returns=_object("results")),
        Route("post", "/rerank", "Rerank (base URL without /v1)", body=RerankBody, returns=_object("results")),
        Route("post", "/v1/score", "vLLM's score: text_1 against text_2", body=ScoreBody, returns=_LIST),
        Route("post", "/score", "vLLM's score (base URL without /v1)", body=ScoreBody, returns=_LIST),
        Route("post", "/tokenize", "Token ids of a text or chat (llama.cpp's and vLLM's shapes)", body=TokenizeRequest,
              returns=_object("tokens")),
        Route("post", "/detokenize", "Text of token ids", body=DetokenizeRequest, returns=_object("content", "prompt")),
        Route("post", "/apply-template", "A chat rendered with the model's template", body=ChatCompletionRequest,
              returns=_object("prompt")),
        Route("post", "/v1/audio/transcriptions", "Speech to text", raw_body="multipart/form-data", streams=("application/x-ndjson",)),
        Route("post", "/v1/audio/translations", "Not served (501)", raw_body="multipart/form-data", always=501),
        Route("post", "/v1/audio/speech", "Text to speech", body=SpeechRequest, success="audio/wav", streams=("audio/pcm",)),
        Route("post", "/v1/audio/generate", "Music (no model ships weights)", body=GenerateRequest),
        Route("get", "/v1/audio/jobs/{job_id}", "An audio job", returns=_object("id", "status")),
        Route("get", "/v1/audio/jobs/{job_id}/result", "An audio job's result"),
        Route("delete", "/v1/audio/jobs/{job_id}", "Cancel or remove an audio job"),
        Route("get", "/v1/audio/models", "The audio models", returns=_LIST),
        Route("post", "/v1/audio/models", "Attach an audio model", raw_body="application/json"),
        Route("delete", "/v1/audio/models/{model_id}", "Detach an audio model"),
        Route("get", "/v1/audio/transcriptions/realtime", "Realtime transcription (WebSocket upgrade)"),
        Route("get", "/v1/realtime", "OpenAI's Realtime API: voice conversations and transcription (WebSocket upgrade)"),
        Route("post", "/v1/images/generations", "OpenAI image generation", body=ImageRequest,
              streams=sse, returns=_object("created", "data")),
        Route("post", "/v1/images/edits", "OpenAI image edit (multipart: image and prompt)", raw_body="multipart/form-data",
              streams=sse, returns=_object("created", "data")),
        Route("get", "/v1/images/files/{name}", "An image made for response_format url (kept an hour)", success="image/png"),
    ]
    ndjson = ("application/x-ndjson",)
    out += [
        Route("post", "/api/chat", "Ollama chat", "ollama", body=OllamaChatRequest, streams=ndjson,
              returns=_object("model", "done")),
        Route("post", "/api/generate", "Ollama generate", "ollama", body=OllamaGenerateRequest, streams=ndjson,
              returns=_object("model", "done")),
        Route("get", "/", "Ollama's liveness answer", "ollama", success="text/plain"),
        Route("get", "/api/version", "The server's version", "ollama", returns=_object("version")),
        Route("get", "/api/tags", "Stored models", "ollama", returns=_object("models")),
        Route("post", "/api/show", "One model's details", "ollama", raw_body="application/json",
              returns=_object("details")),
        Route("get", "/api/ps", "Loaded models", "ollama", returns=_object("models")),
        Route("delete", "/api/delete", "Delete a stored model", "ollama", raw_body="application/json"),
        Route("post", "/api/copy", "Copy a stored model", "ollama", raw_body="application/json"),
        Route("post", "/api/pull", "Pull a catalogue model (NDJSON progress)", "ollama",
              raw_body="application/json", streams=ndjson),
        Route("get", "/api/catalogue", "The models /api/pull can fetch", "ollama", returns=_object("models")),
        Route("get", "/v1/mcp/tools", "The MCP servers the server runs (serve --mcp-config): state and tools",
              returns=_LIST),
        Route("get", "/status/feed", "Live status snapshots (SSE; ?interval=seconds)", success="text/event-stream"),
        Route("get", "/ui/{name}", "The web page's files (GET / with Accept: text/html is the page)", success="text/javascript"),
        Route("get", "/slots", "llama.cpp's slots: the prefix cache's places", "openai", returns={"type": "array"}),
        Route("post", "/slots/{slot}", "Save, restore or erase a slot (?action=)", "openai", raw_body="application/json"),
        Route("post", "/api/create", "Make a model from a stored one, from uploaded files or from Ollama's store "
              "(NDJSON status)", "ollama", raw_body="application/json", streams=ndjson),
        Route("post", "/api/blobs/{digest}", "Upload a file for /api/create's files (201; HEAD: is it there)", "ollama",
              raw_body="application/octet-stream", success="text/plain"),
        Route("get", "/api/ollama/models", "The models in Ollama's store on this machine, for import", "ollama",
              returns=_object("models")),
    ]
    return tuple(out)


ROUTES: tuple[Route, ...] = ()  # filled on first use (the wire modules import the codec)


def routes() -> tuple[Route, ...]:
    global ROUTES
    if not ROUTES:
        ROUTES = _routes()
    return ROUTES


_ERRORS = {
    "openai": _object("error", error=_object("message", "type", message={"type": "string"}, type={"type": "string"})),
    "anthropic": _object("type", "error", type={"const": "error"},
                         error=_object("type", "message", type={"type": "string"}, message={"type": "string"})),
    "ollama": _object("error", error={"type": "string"}),
}


def error_schema(family: str) -> dict[str, Any]:
    return _ERRORS[family]


# --- JSON Schema from attrs classes ----------------------------------------------------------

def schema_for(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a type annotation; attrs classes go to ``components``."""
    if tp is Any or tp is object:
        return {}
    if attrs.has(tp):
        name = tp.__name__
        if name not in components:
            components[name] = {}  # a placeholder, so a recursive type refers to itself
            components[name] = _attrs_schema(tp, components)
        return {"$ref": f"#/components/schemas/{name}"}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [schema_for(a, components) for a in args]
        return {"anyOf": options}
    if origin in (list, tuple) or tp in (list, tuple):
        return {"type": "array", "items": schema_for(args[0], components) if args else {}}
    if origin is dict or tp is dict:
        return {"type": "object", "additionalProperties": schema_for(args[1], components) if args else {}}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
    if tp in simple:
        return {"type": simple[tp]}
    return {}


def _attrs_schema(cls: type, components: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required = []
    for field in attrs.fields(cls):
        props[field.name] = schema_for(hints.get(field.name, Any), components)
        if field.default is attrs.NOTHING:
            required.append(field.name)
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    if cls.__doc__:
        out["description"] = " ".join(cls.__doc__.split())
    return out


def document(route_list: Iterable[Route] | None = None) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for r in route_list or routes():
        op: dict[str, Any] = {"summary": r.summary, "tags": [r.family]}
        if r.body is not None:
            op["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": schema_for(r.body, components)}},
            }
        elif r.raw_body is not None:
            op["requestBody"] = {"required": True, "content": {r.raw_body: {"schema": {}}}}
        success: dict[str, Any] = {r.success: {"schema": r.returns or {}}}
        for media in r.streams:
            success[media] = {"schema": {"type": "string"}}
        error = {"content": {"application/json": {"schema": error_schema(r.family)}}}
        op["responses"] = {
            "200": {"description": "success", "content": success},
            "4XX": {"description": "refused, in the family's error shape", **error},
            "5XX": {"description": "failed; the message carries an error id, never internal detail", **error},
        }
        params = [seg[1:-1] for seg in r.path.split("/") if seg.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
        paths.setdefault(r.path, {})[r.method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "turbospark", "version": __version__,
                 "description": "A local generation server speaking the OpenAI, Anthropic and Ollama APIs."},
        "paths": paths,
        "components": {"schemas": components},
    }
