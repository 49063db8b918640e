"""The audio routes' checks, messages and output formats (sans-io).

The original server's limits and error texts (see ``design/decisions/0012-audio.md``): every
failure is one ``TurboSparkError`` subclass, answered in the OpenAI error shape with ``param``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container, Mapping, Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid, TurboSparkError

__all__ = [
    "MAX_AUDIO_SECONDS",
    "MAX_SPEECH_CHARS",
    "MAX_UPLOAD",
    "OPENAI_STT_NAMES",
    "OPENAI_TTS_NAMES",
    "RESPONSE_FORMATS",
    "Segment",
    "SpeechRequest",
    "Transcript",
    "TranscriptionOptions",
    "Unsupported",
    "UnsupportedMedia",
    "UploadTooLarge",
    "check_fields",
    "check_flag",
    "check_generate",
    "check_speech",
    "render_transcript",
    "required_model",
    "transcription_options",
]

MAX_UPLOAD = 128 * 1024 * 1024
MAX_AUDIO_SECONDS = 1800
MAX_SPEECH_CHARS = 4096
RESPONSE_FORMATS = ("json", "verbose_json", "text", "srt", "vtt")
RAW_AUDIO_TYPES = ("", "audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "application/octet-stream")
#: What the OpenAI SDKs and clients send for ``model``: served by the first model of the task.
OPENAI_STT_NAMES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
OPENAI_TTS_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")

_LANGUAGE = re.compile(r"[A-Za-z0-9_-]{1,16}")


class UnsupportedMedia(TurboSparkError):
    status = 415
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.param = "file"


class UploadTooLarge(TurboSparkError):
    status = 413
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("request body too large; audio uploads are limited to 128 MiB")


class Unsupported(TurboSparkError):
    status = 501
    type = "invalid_request_error"


@attrs.frozen
class Segment:
    start: float
    end: float
    text: str


@attrs.frozen
class Transcript:
    text: str
    language: str
    duration: float  # seconds of 16 kHz audio
    segments: tuple[Segment, ...]


@attrs.frozen
class TranscriptionOptions:
    model: str
    language: str | None  # None: the model's own (or detected)
    response_format: str
    stream: bool
    run_async: bool


def check_fields(fields: Mapping[str, Any], allowed: Container[str], *, what: str = "field") -> None:
    """Refuse the first of ``fields`` (a JSON body, form fields, a query string) not ``allowed``."""
    for key in fields:
        if key not in allowed:
            raise RequestInvalid(f'the {what} "{key}" is not supported by this server', param=key)


def required_model(fields: Mapping[str, Any]) -> str:
    """The ``model`` a request names (a string, not blank), stripped."""
    model = _field(fields, "model", str, "a string")
    if not model or not model.strip():
        raise RequestInvalid("model is required", param="model")
    return model.strip()


def check_flag(value: str, name: str) -> bool:
    """A boolean form field or query parameter: true or 1, false, 0 or empty."""
    v = value.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0", ""):
        return False
    raise RequestInvalid(f"{name} must be true or false, not \"{value}\"", param=name)


def check_language(value: str | None) -> str | None:
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    if not _LANGUAGE.fullmatch(value):
        raise RequestInvalid(
            f"language must be up to 16 letters, digits, '-' or '_' (an ISO-639-1 code such as en), not \"{value[:40]}\"",
            param="language",
        )
    return value.lower()


def transcription_options(fields: Mapping[str, str]) -> TranscriptionOptions:
    """The options of a transcription request, from its form fields or query string."""
    allowed = {"model", "language", "response_format", "stream", "async", "prompt", "temperature",
               "timestamp_granularities[]", "timestamp_granularities"}  # fmt: skip
    check_fields(fields, allowed)
    model = required_model(fields)
    fmt = fields.get("response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise RequestInvalid(
            f'response_format "{fmt}" is not supported; use json, verbose_json, text, srt or vtt',
            param="response_format",
        )
    stream = check_flag(fields.get("stream", ""), "stream")
    run_async = check_flag(fields.get("async", ""), "async")
    if stream and run_async:
        raise RequestInvalid("stream and async cannot both be true", param="stream")
    if (fields.get("prompt") or "").strip():
        raise RequestInvalid("prompt is not supported by this server; leave it empty", param="prompt")
    temperature = fields.get("temperature")
    if temperature not in (None, ""):
        try:
            t = float(temperature)
        except ValueError:
            t = math.nan
        if t != 0:
            raise RequestInvalid("temperature must be 0: transcription is greedy", param="temperature")
    for key in ("timestamp_granularities[]", "timestamp_granularities"):
        if key in fields and fields[key] not in ("segment", ""):
            raise RequestInvalid(
                f'timestamp granularity "{fields[key]}" is not supported; only segment', param=key
            )
    return TranscriptionOptions(model, check_language(fields.get("language")), fmt, stream, run_async)


# --- output formats ---------------------------------------------------------------------------


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render_transcript(t: Transcript, fmt: str) -> tuple[bytes, str]:
    """The body and content type of ``t`` in ``response_format`` ``fmt``."""
    if fmt == "json":
        return _json({"text": t.text}), "application/json"
    if fmt == "verbose_json":
        body = {
            "task": "transcribe",
            "language": t.language,
            "duration": t.duration,
            "text": t.text,
            "segments": [
                {"id": i, "start": s.start, "end": s.end, "text": s.text} for i, s in enumerate(t.segments)
            ],
        }
        return _json(body), "application/json"
    if fmt == "text":
        return (t.text + "\n").encode(), "text/plain; charset=utf-8"
    if fmt == "srt":
        parts = [
            f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
            for i, s in enumerate(t.segments, start=1)
        ]
        return "".join(parts).encode(), "application/x-subrip; charset=utf-8"
    if fmt == "vtt":
        parts = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n" for s in t.segments]
        return ("WEBVTT\n\n" + "".join(parts)).encode(), "text/vtt; charset=utf-8"
    raise ValueError(fmt)


def _json(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


# --- speech --------------------------------------------------------------------------------------


@attrs.frozen
class SpeechRequest:
    model: str
    input: str
    voice: str | None
    speed: float
    response_format: str  # wav | pcm
    stream: bool


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RequestInvalid(f"{name} must be {what}", param=name)
    return value


def _json_model(body: Any, allowed: Container[str]) -> str:
    """The model a JSON request ``body`` names, once it is an object with no field outside ``allowed``."""
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    check_fields(body, allowed)
    return required_model(body)


def check_speech(body: Any) -> SpeechRequest:
    """``POST /v1/audio/speech``'s body, in the original server's order of checks."""
    model = _json_model(body, {"model", "input", "text", "voice", "speed", "response_format", "stream", "instructions"})
    if "input" in body and "text" in body:
        raise RequestInvalid("send input or text, not both", param="input")
    text = _field(body, "input", str, "a string") if "input" in body else _field(body, "text", str, "a string")
    if text is None or not text.strip():
        raise RequestInvalid("input must not be blank", param="input")
    if len(text) > MAX_SPEECH_CHARS:
        raise RequestInvalid(
            f"input is {len(text)} characters; the limit is {MAX_SPEECH_CHARS}", param="input"
        )
    if (_field(body, "instructions", str, "a string") or "").strip():
        raise RequestInvalid("instructions are not supported by this server's voices", param="instructions")
    voice = _field(body, "voice", str, "a string")
    speed = _field(body, "speed", (int, float), "a number")
    speed = 1.0 if speed is None else float(speed)
    if not (0.5 <= speed <= 2.0) or not math.isfinite(speed):
        raise RequestInvalid(f"speed must be between 0.5 and 2.0, got {speed}", param="speed")
    fmt = _field(body, "response_format", str, "a string") or "wav"
    if fmt not in ("wav", "pcm"):
        raise RequestInvalid(f'response_format "{fmt}" is not supported; use wav or pcm', param="response_format")
    stream = bool(_field(body, "stream", bool, "a boolean"))
    if stream and fmt == "wav":
        raise RequestInvalid(
            'stream needs response_format "pcm" (a WAV header carries the length)', param="stream"
        )
    return SpeechRequest(model, text, voice, speed, fmt, stream)


@attrs.frozen
class GenerateRequest:
    model: str
    prompt: str
    lyrics: str
    audio_length: float | None
    steps: int | None
    seed: int | None
    run_async: bool


def check_generate(body: Any) -> GenerateRequest:
    """``POST /v1/audio/generate`` (music)'s body."""
    allowed = {"model", "prompt", "lyrics", "audio_length", "num_inference_steps", "seed", "response_format", "async"}
    model = _json_model(body, allowed)
    prompt = _field(body, "prompt", str, "a string")
    if prompt is None or not prompt.strip():
        raise RequestInvalid("prompt must not be blank", param="prompt")
    lyrics = _field(body, "lyrics", str, "a string")
    lyrics = lyrics if lyrics and lyrics.strip() else "[instrumental]"
    length = _field(body, "audio_length", (int, float), "a number")
    if length is not None and not (0 < length <= 360):
        raise RequestInvalid(f"audio_length must be in (0, 360] seconds, got {length}", param="audio_length")
    steps = _field(body, "num_inference_steps", int, "an integer")
    if steps is not None and not (1 <= steps <= 30):
        raise RequestInvalid(f"num_inference_steps must be 1 to 30, got {steps}", param="num_inference_steps")
    seed = _field(body, "seed", int, "an integer")
    fmt = _field(body, "response_format", str, "a string") or "wav"
    if fmt != "wav":
        raise RequestInvalid(f'response_format "{fmt}" is not supported; use wav', param="response_format")
    run_async = bool(_field(body, "async", bool, "a boolean"))
    return GenerateRequest(model, prompt, lyrics, None if length is None else float(length), steps, seed, run_async)


def check_duration(samples: int, rate: int) -> None:
    if samples == 0:
        raise RequestInvalid("the audio has no samples", param="file")
    seconds = samples / rate
    if seconds > MAX_AUDIO_SECONDS:
        raise RequestInvalid(
            f"audio is {seconds:.1f} s; the limit is {MAX_AUDIO_SECONDS} s", param="file"
        )


def segments_json(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    return [{"start": s.start, "end": s.end, "text": s.text} for s in segments]
