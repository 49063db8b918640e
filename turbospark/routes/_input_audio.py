"""OpenAI's ``input_audio`` parts in chat messages (``{"type": "input_audio", "input_audio":
{"data": <base64>, "format": "wav"}}``), for a text model: each part is transcribed by the
speech-to-text model (``whisper-1``'s: the only one attached, or the one loaded) and takes its
place in the message as text; the degradation header says so ("input_audio (transcribed by
...)").  A WAV of any rate and channels is read (``audio/wav``); another format, data that is
not base64 or not a WAV, or no speech-to-text model is a 400 naming the part.  The
transcription is the request's own work: a client that leaves cancels it."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import attrs
import trio
from quart import g

from ..audio import wav
from ..audio.messages import Transcribe, WorkFailed
from ..audio.wire import check_duration
from ..errors import RequestInvalid, TurboSparkError
from ..web.app import request_scope
from ..wire.openai import ChatCompletionRequest
from ._audio import receive, resolve_audio, submit

__all__ = ["transcribed_audio"]


def _audio_of(part: dict[str, Any], where: str) -> Any:
    given = part.get("input_audio")
    if not isinstance(given, dict) or not isinstance(given.get("data"), str):
        raise RequestInvalid(f"{where}.input_audio needs data (base64) and a format", param="messages")
    if given.get("format", "wav") != "wav":
        raise RequestInvalid(f'{where}.input_audio.format "{given.get("format")}" is not read here: send wav',
                             param="messages")
    try:
        data = base64.b64decode(given["data"], validate=True)
        audio = wav.decode(data)
    except (binascii.Error, ValueError, wav.NotWav, wav.AudioInvalid) as exc:
        raise RequestInvalid(f"{where}.input_audio is not a base64 WAV: {exc}", param="messages") from None
    check_duration(len(audio), wav.SAMPLE_RATE)
    return audio


async def transcribed_audio(body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """``body`` with its ``input_audio`` parts as text parts (their transcripts), and the label
    for the degradation header (none where it has no such part)."""
    found = [(i, j, part) for i, m in enumerate(body.messages) if isinstance(m.content, list)
             for j, part in enumerate(m.content) if isinstance(part, dict) and part.get("type") == "input_audio"]
    if not found:
        return body, []
    try:
        info = await resolve_audio("whisper-1", "speech_to_text")
    except TurboSparkError:
        raise RequestInvalid("input_audio parts are transcribed for this text model, but no speech-to-text "
                             "model is attached", param="messages") from None
    texts: dict[tuple[int, int], str] = {}
    for i, j, part in found:
        audio = await trio.to_thread.run_sync(_audio_of, part, f"messages[{i}].content[{j}]", abandon_on_cancel=True)
        recv = await submit(request_scope(), request_id=g.record.id, model=info.id, endpoint="transcriptions",
                            args=Transcribe(audio, None))
        reply = await receive(recv)
        if isinstance(reply, WorkFailed):
            raise reply.error
        texts[i, j] = reply.transcript.text if reply.transcript is not None else ""
    messages = [
        attrs.evolve(m, content=[{"type": "text", "text": texts[i, j]} if (i, j) in texts else p
                                 for j, p in enumerate(m.content)]) if any(k[0] == i for k in texts) else m
        for i, m in enumerate(body.messages)
    ]
    return attrs.evolve(body, messages=messages), [f"input_audio (transcribed by {info.id})"]
