"""The app with every route family: the blueprints this process serves."""

from __future__ import annotations

from quart import Blueprint
from quart_trio import QuartTrio

from .._system import System
from ..web.app import create_app as _create_app
from . import (
    anthropic, audio, audio_realtime, health, images, mcp, metrics, models, ollama, ollama_create, ollama_embed, ollama_models,
    ollama_pull, openai_chat, openai_completions, openai_embeddings, openai_responses, openapi_doc,
    page, realtime, slots, status_feed, tokenize,
)
from . import rerank

__all__ = ["create_app"]


def create_app(sys_: System) -> QuartTrio:
    blueprints: list[Blueprint] = [
        health.blueprint, models.blueprint, metrics.blueprint, openai_chat.blueprint,
        openai_completions.blueprint, openai_responses.blueprint, openai_embeddings.blueprint,
        ollama_embed.blueprint, ollama.blueprint, ollama_models.blueprint, ollama_pull.blueprint, ollama_create.blueprint,
        anthropic.blueprint, openapi_doc.blueprint, page.blueprint, slots.blueprint, status_feed.blueprint,
        tokenize.blueprint, mcp.blueprint, images.blueprint,  # without an image model: 503, as the original answers
    ]
    blueprints.append(rerank.blueprint)
    if sys_.audio is not None:  # the audio routes exist only with an audio model attached
        blueprints += [audio.blueprint, audio_realtime.blueprint, realtime.blueprint]
    return _create_app(sys_, blueprints)
