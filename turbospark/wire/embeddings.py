"""Embedding request shapes: OpenAI's ``/v1/embeddings`` and Ollama's ``/api/embed`` and
``/api/embeddings``.

Only the types are checked here (by the one converter, unknown fields refused); ``input`` is
typed ``Any`` and checked, with the limits, in the original server's order by
``turbospark.wire.embedding_checks``, so each error carries its exact message.
"""

from __future__ import annotations

from typing import Any

import attrs

from .codec import converter

__all__ = ["EmbeddingRequest", "OllamaEmbedRequest", "OllamaEmbeddingsRequest"]


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    input: Any
    model: str | None = None
    encoding_format: str | None = None  # float (the default) or base64
    dimensions: int | None = None
    user: str | None = None  # an end-user id for OpenAI's abuse monitoring; nothing to do here


@attrs.frozen(kw_only=True)
class OllamaEmbedRequest:
    """``/api/embed``: one string or many."""

    model: str | None = None
    input: Any = None
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None  # how long the model stays loaded after the request


@attrs.frozen(kw_only=True)
class OllamaEmbeddingsRequest:
    """``/api/embeddings`` (Ollama's older route): one prompt."""

    model: str | None = None
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


def _duration(value: Any, _: type) -> str | float | None:
    """Ollama's ``keep_alive``: a duration string ("5m") or a number of seconds."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError("keep_alive must be a duration string or a number of seconds")


converter.register_structure_hook(str | float | None, _duration)
