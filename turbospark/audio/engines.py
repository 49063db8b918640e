"""What an audio engine is (the synchronous interface an audio worker thread drives), and the
scripted engines.

Like a generation backend, an engine is built, loaded and used on its model's one pinned OS
thread, so nothing here is async and nothing imports Trio.  Every engine takes ``check``, a
callable it calls between steps (a Whisper decoder step, a Piper sentence): it raises ``Stop``
when the job's client has gone or the server is shutting down, and the engine lets it propagate.

- ``SpeechToText.transcribe(audio, language, check, prefix="")``: 16 kHz mono float32 in, a
  ``Transcript`` out.  ``prefix``, where given, is text already given for the audio's start (a
  realtime session's words): an engine that can decode from it starts its transcript with it and
  decodes only the rest; the scripted one ignores it.
- ``TextToSpeech.synthesize(text, voice, speed, check)``: 16-bit mono PCM chunks out (one per
  sentence), at ``sample_rate``.

The scripted engines are deterministic and need no model: the scripted speech-to-text engine
says what it heard (``"Scripted transcript of 1.50 s of audio."``, one segment per started
``segment_seconds``), taking one step per 100 ms of audio (``step_delay`` seconds each); the
scripted voice speaks a 440 Hz tone, 50 ms per character of text, at 24 kHz.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import attrs
import numpy as np

from ..errors import RequestInvalid
from .wire import Segment, Transcript

__all__ = [
    "AudioSpec",
    "SCRIPTED_STT_ID",
    "SCRIPTED_TTS_ID",
    "ScriptedSpeechToText",
    "ScriptedTextToSpeech",
    "SpeechToText",
    "Stop",
    "Task",
    "TextToSpeech",
    "check_voice",
]

Task = Literal["speech_to_text", "text_to_speech", "music_generation"]
SCRIPTED_STT_ID = "scripted-stt"
SCRIPTED_TTS_ID = "scripted-tts"
#: OpenAI's voice names: every voice answers to them (an SDK needs one), as its own default.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")

Check = Callable[[], None]


class Stop(Exception):
    """Raised by ``check``: the job's client has gone, or the server is shutting down."""


class SpeechToText(Protocol):
    model_id: str
    task: Task  # "speech_to_text"

    def transcribe(self, audio: np.ndarray, language: str | None, check: Check, prefix: str = "") -> Transcript: ...


class TextToSpeech(Protocol):
    model_id: str
    task: Task  # "text_to_speech"
    sample_rate: int
    voices: tuple[str, ...]  # the first is the default

    def synthesize(self, text: str, voice: str, speed: float, check: Check) -> Iterator[bytes]: ...


Engine = SpeechToText | TextToSpeech


@attrs.frozen
class AudioSpec:
    """An audio model to attach: its id, its task, and how its thread builds the engine."""

    id: str
    task: Task
    make: Callable[[], Engine]


def check_voice(voices: Sequence[str], voice: str | None) -> str:
    """The voice ``voice`` names among a model's ``voices`` (None, "default" or an OpenAI voice
    name: the model's default, its first)."""
    if voice is None or voice in ("", "default") or voice in OPENAI_VOICES:
        return voices[0]
    if voice in voices:
        return voice
    raise RequestInvalid(
        f'voice "{voice}" is not one of this model\'s voices: {", ".join(voices)} '
        f"(or default, or an OpenAI voice name)",
        param="voice",
    )


def english_only(model_id: str, language: str | None) -> str:
    if language not in (None, "en"):
        raise RequestInvalid(f'{model_id} transcribes English only, not "{language}"', param="language")
    return "en"


class ScriptedSpeechToText:
    task: Task = "speech_to_text"

    def __init__(
        self, *, model_id: str = SCRIPTED_STT_ID, step_delay: float = 0.0, segment_seconds: float = 10.0
    ) -> None:
        self.model_id = model_id
        self.step_delay = step_delay
        self.segment_seconds = segment_seconds
        self.steps = 0  #: steps taken, in all (tests read it to see work stop)
        self.calls: list[int] = []  #: samples of every transcription begun
        self.prefixes: list[str] = []  #: and the prefix each was given

    def transcribe(self, audio: np.ndarray, language: str | None, check: Check, prefix: str = "") -> Transcript:
        self.calls.append(len(audio))
        self.prefixes.append(prefix)
        duration = len(audio) / 16000
        for _ in range(max(1, math.ceil(duration * 10))):
            check()
            self.steps += 1
            if self.step_delay:
                time.sleep(self.step_delay)
        check()
        text = f"Scripted transcript of {duration:.2f} s of audio."
        count = max(1, math.ceil(duration / self.segment_seconds))
        segments = tuple(
            Segment(round(i * self.segment_seconds, 3), round(min(duration, (i + 1) * self.segment_seconds), 3),
                    " " + text if count == 1 else f" Part {i + 1} of {text[0].lower()}{text[1:]}")
            for i in range(count)
        )  # fmt: skip
        return Transcript("".join(s.text for s in segments).strip(), language or "en", duration, segments)


class ScriptedTextToSpeech:
    task: Task = "text_to_speech"
    sample_rate = 24_000
    voices: tuple[str, ...] = ("af_heart", "am_adam")

    def __init__(self, *, model_id: str = SCRIPTED_TTS_ID, step_delay: float = 0.0) -> None:
        self.model_id = model_id
        self.step_delay = step_delay
        self.calls: list[tuple[str, str, float]] = []

    def synthesize(self, text: str, voice: str, speed: float, check: Check) -> Iterator[bytes]:
        self.calls.append((text, voice, speed))
        for sentence in _sentences(text):
            check()
            if self.step_delay:
                time.sleep(self.step_delay)
            n = round(len(sentence) * 0.05 * self.sample_rate / speed)
            t = np.arange(n, dtype=np.float32) / self.sample_rate
            tone = 0.3 * np.sin(2 * np.pi * (440.0 if voice == self.voices[0] else 220.0) * t)
            yield (tone * 32767).astype("<i2").tobytes()


def _sentences(text: str) -> Sequence[str]:
    out, current = [], ""
    for ch in text:
        current += ch
        if ch in ".!?\n" and current.strip():
            out.append(current)
            current = ""
    if current.strip():
        out.append(current)
    return out or [text]
