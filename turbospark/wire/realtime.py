"""OpenAI's Realtime API (GA): the shapes a client sends in ``session.update`` and
``response.create``, checked by the one converter (``codec.structure``).  Every key the API
defines is accepted; what the server does with them is ``audio/realtime_state.py``."""

from __future__ import annotations

from typing import Any, Literal

import attrs

__all__ = ["AudioOutput", "RealtimeSession", "ResponseParams"]


@attrs.frozen
class AudioFormat:
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: int | None = None


@attrs.frozen
class TurnDetection:
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


@attrs.frozen
class Transcription:
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    delay: Any = None
    keywords: Any = None
    languages: Any = None


@attrs.frozen
class NoiseReduction:
    type: Literal["near_field", "far_field"] | None = None
    strength: float | None = None


@attrs.frozen
class AudioInput:
    format: AudioFormat | None = None
    transcription: Transcription | None = None
    noise_reduction: NoiseReduction | None = None
    turn_detection: TurnDetection | None = None


@attrs.frozen
class AudioOutput:
    format: AudioFormat | None = None
    voice: Any = None  # a voice's name, or {"id": ...} (a custom voice: the model's default here)
    speed: float | None = None


@attrs.frozen
class SessionAudio:
    input: AudioInput | None = None
    output: AudioOutput | None = None


@attrs.frozen
class RealtimeSession:
    type: Literal["realtime", "transcription"] | None = None
    model: str | None = None
    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    audio: SessionAudio | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    max_output_tokens: Any = None  # a whole number, or "inf"
    temperature: float | None = None
    include: list[str] | None = None
    tracing: Any = None
    truncation: Any = None
    prompt: Any = None
    reasoning: Any = None


@attrs.frozen
class ResponseAudio:
    output: AudioOutput | None = None


@attrs.frozen
class ResponseParams:
    """``response.create``'s ``response``: what this one response does differently."""

    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: Any = None
    temperature: float | None = None
    conversation: str | None = None  # "auto", "none", or a conversation's id (this one)
    input: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    audio: ResponseAudio | None = None
    prompt: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: Any = None
