"""A realtime transcription session's state (sans-io): frames in, what to do out.

The WebSocket route feeds ``binary`` frames (PCM, s16le or f32le) and ``text`` frames (JSON
control messages) and carries out the actions that come back:

- ``Send(message)``: a JSON message to the client; ``close=True`` closes the socket after it.
- ``Commit(segment_id, audio, auto)``: transcribe ``audio`` (16 kHz mono float32) as the final
  text of segment ``segment_id`` (ids count from 0, one per commit, failed ones included).
- ``Partial(audio, audio_end_ms)``: transcribe what the current segment holds so far, as a
  hypothesis (``audio_end_ms``: where it ends, in ms of the session's audio).

Voice activity (``vad=True``, from ``?vad=true`` or ``{"type":"session","vad":true}``): every 30 ms
frame is classified by ``is_speech`` (webrtcvad in the server, anything in tests).  Once speech
has been heard, ``pause_ms`` of silence commits the segment by itself; while speech goes on, a
``Partial`` is asked for every ``partial_every`` seconds of new audio.  Without VAD the client
commits with ``{"type":"commit"}``, as in the original server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .wav import SAMPLE_RATE

__all__ = [
    "BAD_FRAME",
    "Commit",
    "Partial",
    "RealtimeLimits",
    "Send",
    "Session",
    "USAGE",
]

BAD_FRAME = "frame is not whole, finite samples of the chosen encoding"
USAGE = 'send binary PCM frames and {"type":"commit"}'
VAD_FRAME = SAMPLE_RATE * 30 // 1000  # 480 samples: 30 ms
_KEEP_BEFORE_SPEECH = SAMPLE_RATE * 3 // 10  # silence kept before speech starts: 300 ms


@attrs.frozen
class RealtimeLimits:
    max_frame_bytes: int = 1 << 20  # larger frames are refused by the WebSocket layer itself
    max_buffered_seconds: float = 300.0
    idle_seconds: float = 60.0
    max_session_seconds: float = 3600.0
    max_sessions: int = 8
    pause_ms: int = 600  # silence after speech that ends a segment (VAD)
    partial_every: float = 0.5  # seconds of new speech between partial hypotheses (VAD)
    min_speech_ms: int = 90  # voiced audio before a segment counts as speech (VAD)


@attrs.frozen
class Send:
    message: dict[str, Any]
    close: bool = False


@attrs.frozen(eq=False)
class Commit:
    segment_id: int
    audio: np.ndarray
    auto: bool


@attrs.frozen(eq=False)
class Partial:
    audio: np.ndarray
    audio_end_ms: int = 0


Action = Send | Commit | Partial


class Session:
    def __init__(
        self,
        encoding: str,
        *,
        vad: bool = False,
        is_speech: Callable[[bytes], bool] | None = None,
        limits: RealtimeLimits = RealtimeLimits(),
    ) -> None:
        self.encoding = encoding
        self.vad = vad
        self.is_speech = is_speech
        self.limits = limits
        self.next_segment = 0
        self.received = 0  # samples received since the session began
        self._chunks: list[np.ndarray] = []
        self._buffered = 0
        self._reset_vad()

    # --- the buffer ------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        return self._buffered

    def _audio(self) -> np.ndarray:
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0] if self._chunks else np.zeros(0, np.float32)

    def _clear(self) -> None:
        self._chunks, self._buffered = [], 0
        self._reset_vad()

    def _reset_vad(self) -> None:
        self._pending = np.zeros(0, np.float32)  # samples not yet classified (under 30 ms)
        self._voiced_ms = 0
        self._silent_ms = 0
        self._speech = False
        self._since_partial = 0

    # --- frames in --------------------------------------------------------------------------

    def binary(self, data: bytes) -> list[Action]:
        width = 2 if self.encoding == "s16le" else 4
        if len(data) % width:
            return [Send({"type": "error", "message": BAD_FRAME}, close=True)]
        if self.encoding == "s16le":
            samples = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
        else:
            samples = np.frombuffer(data, "<f4").astype(np.float32)
            if not np.all(np.isfinite(samples)):
                return [Send({"type": "error", "message": BAD_FRAME}, close=True)]
        limit = int(self.limits.max_buffered_seconds * SAMPLE_RATE)
        if self._buffered + len(samples) > limit:
            return [Send({
                "type": "error",
                "message": f"more than {self.limits.max_buffered_seconds:g} s of audio buffered; commit more often",
            }, close=True)]  # fmt: skip
        if len(samples) == 0:
            return []
        self._chunks.append(samples)
        self._buffered += len(samples)
        self.received += len(samples)
        return self._detect(samples) if self.vad and self.is_speech is not None else []

    def text(self, data: str) -> list[Action]:
        try:
            msg = json.loads(data)
        except ValueError:
            msg = None
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "commit":
            return [self.commit(auto=False)]
        if kind == "reset":
            self._clear()
            return []
        if kind == "session" and isinstance(msg, dict) and isinstance(msg.get("vad"), bool):
            if msg["vad"] and self.is_speech is None:
                return [Send({"type": "error", "message": "voice activity detection is not available on this server"})]
            self.vad = msg["vad"]
            self._reset_vad()
            return [Send({"type": "session", "vad": self.vad})]
        return [Send({"type": "error", "message": USAGE})]

    def commit(self, *, auto: bool) -> Action:
        if self._buffered == 0:
            return Send({"type": "error", "message": "nothing to commit"})
        audio = self._audio()
        self._clear()
        segment = self.next_segment
        self.next_segment += 1
        return Commit(segment, audio, auto)

    # --- voice activity -----------------------------------------------------------------------

    def _detect(self, samples: np.ndarray) -> list[Action]:
        assert self.is_speech is not None
        actions: list[Action] = []
        pending = np.concatenate([self._pending, samples]) if len(self._pending) else samples
        whole = len(pending) - len(pending) % VAD_FRAME
        self._pending = pending[whole:]
        pcm = (np.clip(pending[:whole], -1, 1) * 32767).astype("<i2")
        for start in range(0, whole, VAD_FRAME):
            voiced = self.is_speech(pcm[start : start + VAD_FRAME].tobytes())
            if voiced:
                self._voiced_ms += 30
                self._silent_ms = 0
                if self._voiced_ms >= self.limits.min_speech_ms:
                    self._speech = True
            else:
                self._silent_ms += 30
                if not self._speech:
                    self._voiced_ms = 0
            if self._speech:
                self._since_partial += VAD_FRAME
            if self._speech and self._silent_ms >= self.limits.pause_ms:
                actions.append(self.commit(auto=True))
                # what followed the pause in this frame batch starts the next segment
                rest = pending[start + VAD_FRAME :]
                return actions + (self._redetect(rest) if len(rest) else [])
        if not self._speech and self._buffered > _KEEP_BEFORE_SPEECH * 2:
            # silence (or too little voice to count) so far: keep only what leads into speech
            audio = self._audio()[-_KEEP_BEFORE_SPEECH:]
            self._chunks, self._buffered = [audio], len(audio)
        if self._speech and self._since_partial >= self.limits.partial_every * SAMPLE_RATE:
            self._since_partial = 0
            actions.append(Partial(self._audio(), self.received * 1000 // SAMPLE_RATE))
        return actions

    def _redetect(self, rest: np.ndarray) -> list[Action]:
        """Classify the audio after an automatic commit as the start of the next segment."""
        self._chunks, self._buffered = [rest.copy()], len(rest)
        return self._detect(rest)
