"""OpenAI's Realtime API (GA event names), the parts without I/O that carry audio and events
(what a session holds, its configuration and items, is ``realtime_state.py``);
``routes/realtime.py`` carries a session out over a WebSocket.

- ``event``, ``new_id``, ``Invalid``: server events, their ids, and a refusal with the API's code.
- ``decode_audio``/``encode_audio``: ``audio/pcm`` (24 kHz, 16-bit), ``audio/pcmu`` and
  ``audio/pcma`` (G.711 at 8 kHz) in and out.
- ``InputBuffer``: the audio appended and not yet committed, at the rate it came in; a commit is
  resampled whole to the 16 kHz float32 the speech-to-text model reads (as the transcription
  route resamples a file), and silence before speech is let go as it ages.
- ``TurnDetector``: server VAD over 30 ms frames: speech started, paused (long enough to begin
  transcribing early), resumed, stopped.

Text in and out (``Agreement``, ``Sentences``, ``Spoken``) is ``realtime_text.py``.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..errors import RequestInvalid
from .wav import SAMPLE_RATE, resample

__all__ = [
    "OUTPUT_RATE",
    "InputBuffer",
    "Invalid",
    "SpeechPaused",
    "SpeechResumed",
    "SpeechStarted",
    "SpeechStopped",
    "TurnDetector",
    "decode_audio",
    "encode_audio",
    "error_event",
    "event",
    "new_id",
]

OUTPUT_RATE = 24_000  # audio/pcm, in and out
_G711_RATE = 8_000


class Invalid(RequestInvalid):
    """A client event refused: an ``error`` event with this ``code`` (the API's names)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param)
        self.code = code


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event: its ``type``, a fresh ``event_id``, and ``fields``."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(exc: RequestInvalid | Any, event_id: str | None = None) -> dict[str, Any]:
    """An ``error`` event for a refused (or failed) client event; ``event_id``: the client's."""
    body = {"type": exc.type, "code": getattr(exc, "code", None), "message": exc.message,
            "param": getattr(exc, "param", None), "event_id": event_id}
    return event("error", error=body)


# --- audio ------------------------------------------------------------------------------------


def _resample(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    if rate == to or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    n = int(round(samples.size * to / rate))
    return np.interp(np.arange(n) * (rate / to), np.arange(samples.size), samples).astype(np.float32)


def _ulaw_decode(data: np.ndarray) -> np.ndarray:
    u = ~data.astype(np.int32) & 0xFF
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.float32) / 32768.0


def _ulaw_encode(x: np.ndarray) -> np.ndarray:
    pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int32) >> 2  # 14 bits
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    pcm = np.minimum(np.abs(pcm), 8159) + 0x21
    seg = np.searchsorted(_ULAW_SEGMENT_ENDS, pcm)
    value = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((pcm >> (np.minimum(seg, 7) + 1)) & 0x0F))
    return (value ^ mask).astype(np.uint8)


_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])


def _alaw_decode(data: np.ndarray) -> np.ndarray:
    a = data.astype(np.int32) ^ 0x55
    sign, exponent, mantissa = a & 0x80, (a >> 4) & 0x07, a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(sign != 0, magnitude, -magnitude).astype(np.float32) / 32768.0


def _alaw_encode(x: np.ndarray) -> np.ndarray:
    pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int32) >> 3  # 13 bits
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    pcm = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = np.searchsorted(_ALAW_SEGMENT_ENDS, pcm)
    low = np.where(seg < 2, pcm >> 1, pcm >> np.minimum(seg, 7)) & 0x0F
    value = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | low)
    return (value ^ mask).astype(np.uint8)


_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def decode_audio(b64: Any, fmt: str) -> tuple[np.ndarray, int]:
    """An ``input_audio_buffer.append``'s ``audio``: mono float32 samples and their rate."""
    if not isinstance(b64, str):
        raise RequestInvalid("audio must be a base64 string", param="audio")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise RequestInvalid("audio is not valid base64", param="audio") from None
    if fmt == "audio/pcm":
        if len(raw) % 2:
            raise RequestInvalid("audio/pcm is 16-bit samples: an odd number of bytes", param="audio")
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0, OUTPUT_RATE
    data = np.frombuffer(raw, np.uint8)
    return (_ulaw_decode(data) if fmt == "audio/pcmu" else _alaw_decode(data)), _G711_RATE


def for_detection(samples: np.ndarray, rate: int) -> np.ndarray:
    """Samples at 16 kHz for voice activity detection (linear: a chunk at a time, no edges)."""
    return _resample(samples, rate, SAMPLE_RATE)


class InputBuffer:
    """Audio appended and not committed: chunks at the rate each came in.  ``seconds`` and
    ``trim`` count time; ``take`` empties it and gives the whole at 16 kHz (polyphase, as
    ``wav.decode`` resamples a file, so a commit reads as the same audio sent as a file);
    ``peek`` gives the same and keeps it."""

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, int]] = []
        self.seconds = 0.0

    def append(self, samples: np.ndarray, rate: int) -> None:
        self._chunks.append((samples, rate))
        self.seconds += samples.size / rate

    def trim(self, keep_seconds: float) -> None:
        """Keep only the last ``keep_seconds`` (silence before speech that can no longer be
        part of a turn)."""
        if self.seconds <= keep_seconds:
            return
        kept, total = [], 0.0
        for samples, rate in reversed(self._chunks):
            room = keep_seconds - total
            if room <= 0:
                break
            if samples.size / rate > room:
                samples = samples[samples.size - int(np.ceil(room * rate)):]
            kept.append((samples, rate))
            total += samples.size / rate
        self._chunks = kept[::-1]
        self.seconds = total

    def take(self) -> np.ndarray:
        whole = self.peek()
        self._chunks, self.seconds = [], 0.0
        return whole

    def peek(self) -> np.ndarray:
        """The whole at 16 kHz, as ``take`` gives it, left in the buffer."""
        runs: list[tuple[list[np.ndarray], int]] = []
        for samples, rate in self._chunks:
            if runs and runs[-1][1] == rate:
                runs[-1][0].append(samples)
            else:
                runs.append(([samples], rate))
        parts = [resample(np.concatenate(chunks), rate) for chunks, rate in runs]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def encode_audio(pcm16: bytes, rate: int, fmt: str) -> bytes:
    """A voice's 16-bit PCM at ``rate`` as the session's output format."""
    samples = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
    if fmt == "audio/pcm":
        out = _resample(samples, rate, OUTPUT_RATE)
        return np.clip(np.round(out * 32768.0), -32768, 32767).astype("<i2").tobytes()
    out = _resample(samples, rate, _G711_RATE)
    return (_ulaw_encode(out) if fmt == "audio/pcmu" else _alaw_encode(out)).tobytes()


def bytes_per_second(fmt: str) -> int:
    return OUTPUT_RATE * 2 if fmt == "audio/pcm" else _G711_RATE


# --- turn detection -------------------------------------------------------------------------

_FRAME = SAMPLE_RATE * 30 // 1000  # 480 samples: 30 ms
#: ms of silence after speech at which a turn's transcription may begin
EARLY_MS = 200


@attrs.frozen
class SpeechStarted:
    audio_start_ms: int


@attrs.frozen
class SpeechStopped:
    audio_end_ms: int


@attrs.frozen
class SpeechPaused:
    """``early_ms`` of silence after speech: the turn may end here (its transcription can begin
    while VAD waits out the rest of its silence)."""

    audio_end_ms: int


@attrs.frozen
class SpeechResumed:
    """Speech again after a ``SpeechPaused``, within the same turn."""


class TurnDetector:
    """Server VAD: ``feed`` 16 kHz audio, get ``SpeechStarted`` once ``min_speech_ms`` of it is
    voiced and ``SpeechStopped`` after ``silence_duration_ms`` of silence (times from the start
    of the session's audio).  ``is_speech`` classifies one 30 ms frame of 16-bit PCM.

    Between them, ``SpeechPaused`` after ``early_ms`` of silence (where that is shorter than
    ``silence_duration_ms``) and ``SpeechResumed`` if speech comes back before the turn ends."""

    def __init__(self, is_speech: Callable[[bytes], bool], *, silence_duration_ms: int = 500,
                 prefix_padding_ms: int = 300, min_speech_ms: int = 90, start_ms: int = 0,
                 early_ms: int = EARLY_MS) -> None:
        self.is_speech = is_speech
        self.silence_ms = silence_duration_ms
        self.prefix_ms = prefix_padding_ms
        self.min_speech_ms = min_speech_ms
        self.early_ms = early_ms
        self.speaking = False
        self.paused = False
        self._pending = np.zeros(0, np.float32)
        self._at = start_ms  # ms of the session's audio classified
        self._voiced = 0
        self._silent = 0

    def feed(self, audio: np.ndarray) -> list[SpeechStarted | SpeechPaused | SpeechResumed | SpeechStopped]:
        out: list[SpeechStarted | SpeechPaused | SpeechResumed | SpeechStopped] = []
        samples = np.concatenate([self._pending, audio]) if self._pending.size else audio
        whole = samples.size - samples.size % _FRAME
        self._pending = samples[whole:].copy()
        for start in range(0, whole, _FRAME):
            frame = np.clip(samples[start:start + _FRAME] * 32768.0, -32768, 32767).astype("<i2").tobytes()
            self._at += 30
            if self.is_speech(frame):
                self._voiced += 30
                self._silent = 0
                if self.paused:
                    self.paused = False
                    out.append(SpeechResumed())
                if not self.speaking and self._voiced >= self.min_speech_ms:
                    self.speaking = True
                    out.append(SpeechStarted(max(0, self._at - self._voiced - self.prefix_ms)))
            else:
                self._silent += 30
                if not self.speaking:
                    self._voiced = 0
                elif self._silent >= self.silence_ms:
                    self.speaking, self.paused, self._voiced = False, False, 0
                    out.append(SpeechStopped(self._at - self._silent))
                elif not self.paused and self._silent >= self.early_ms:
                    self.paused = True
                    out.append(SpeechPaused(self._at - self._silent))
        return out

    def reset(self) -> None:
        self.speaking, self.paused, self._voiced, self._silent = False, False, 0, 0

    @property
    def silent_ms(self) -> int:
        """The silence since the last voiced frame, in ms (0 while the speaker talks)."""
        return self._silent

    def lookback_ms(self) -> int:
        """The recent audio, in ms, that a turn starting now would hold (its padding, the voiced
        frames so far, the frame not yet classified); older audio is no turn's while silent."""
        return self.prefix_ms + self._voiced + 30
