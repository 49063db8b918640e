"""Whisper on MLX (``mlx-whisper``), from a model directory in the store.

``mlx_whisper.transcribe`` does the windowing, the decoding with temperature fallback and the
segmenting; this wraps it so that a job's ``check`` runs before the encoder and before every
decoder step (a client that leaves stops its transcription within one step).  ``mlx_whisper``
keeps its model in a process-wide holder keyed by path, so transcriptions are serialised by one
lock: the thread holding it puts its own model there first.

The encoder reads the audio there is, not a whole 30-second window (whisper.cpp's audio
context, decision 0044): a window's mel frames past the clip are the zeros ``pad_or_trim``
appended, and the encoder runs on the clip's frames and ``MARGIN`` frames of that padding (its
positional embedding cut to match); the decoder attends to those positions alone.  Every clip
is first given ``PAD`` seconds of silence: with little context after the speech (a realtime
partial hypothesis, a clip cut short, even a turn's 200 ms pause) a short window now and then
hears the speech twice (the decoder's timestamps send ``transcribe`` back over its end); with
the silence and ``MARGIN`` frames, never in 192 clips (decision 0045).

A ``prefix`` (a realtime session's words given so far) is decoded as forced tokens in one
step, without timestamps, where the clip fits one window (``PREFIXED_SECONDS``): the decoder
then takes a step only for each new token, and a 9 s turn's hypothesis takes ~220 ms, not ~340.

Where turbospark's CPU kernels are built, the encoder and decoder run through them
(``whisper_kernels.py``, decision 0045: 8-bit products, the kernels' attention and GELU);
elsewhere on mlx-whisper's own layers.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .engines import Check, Task, english_only
from .wire import Segment, Transcript

__all__ = ["WhisperSpeechToText"]

_LOCK = threading.Lock()

#: mel frames (10 ms each) of the window's padding the encoder reads after the clip's own
MARGIN = 700
#: seconds of silence put after every clip
PAD = 0.5
#: the longest clip a ``prefix`` is decoded from (beyond it, a transcription of its own)
PREFIXED_SECONDS = 28.0


class _Checked:
    """A model part that runs the current job's ``check`` before every call."""

    def __init__(self, part: Any, owner: WhisperSpeechToText) -> None:
        self._part, self._owner = part, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._owner._check()
        return self._part(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._part, name)


class _Fitted(_Checked):
    """The encoder on a window's clip and ``MARGIN`` frames of its padding, the job's ``check``
    first (``AudioEncoder.__call__`` with its positional embedding cut to the frames read),
    through the kernels where they serve."""

    def __call__(self, mel: Any) -> Any:
        import mlx.core as mx
        import mlx.nn as nn

        fast = self._owner.fast
        self._owner._check()
        enc = self._part
        filled = np.flatnonzero(np.asarray(mx.max(mx.abs(mel), axis=(0, 2))))  # pad_or_trim's are exact zeros
        frames = min(mel.shape[1], (int(filled[-1]) + 1 if len(filled) else 0) + MARGIN)
        if fast is not None:
            return fast.encode(mel[:, : frames + frames % 2])
        x = nn.gelu(enc.conv1(mel[:, : frames + frames % 2]))
        x = nn.gelu(enc.conv2(x))
        x = x + enc._positional_embedding[: x.shape[1]]
        for block in enc.blocks:
            x, _, _ = block(x)
        return enc.ln_post(x)


def _on_kernels(model: Any) -> Any:
    """The model's layers through the kernels, where they are built and serve the CPU."""
    import mlx.core as mx

    from ..kernels import ops

    if not ops.available() or mx.default_device() != mx.cpu:
        return None
    from .whisper_kernels import KernelWhisper

    return KernelWhisper(model)


class WhisperSpeechToText:
    task: Task = "speech_to_text"

    def __init__(self, path: Path, *, model_id: str) -> None:
        import mlx.core as mx
        from mlx_whisper.load_models import load_model

        self.model_id = model_id
        self.path = Path(path)
        self.model = load_model(str(self.path), dtype=mx.float32)
        self.multilingual = self.model.is_multilingual
        self.fast = _on_kernels(self.model)
        # Checks inside the model: before the encoder and before each decoder step.
        self.model.encoder = _Fitted(self.model.encoder, self)
        self.model.decoder = _Checked(self.fast.decoder if self.fast is not None else self.model.decoder, self)
        self._check: Check = lambda: None
        self._warm()

    def _warm(self) -> None:
        """One short transcription, so the first request does not pay for MLX's first calls."""
        self.transcribe(np.zeros(1600, np.float32), "en", lambda: None)

    def transcribe(self, audio: np.ndarray, language: str | None, check: Check, prefix: str = "") -> Transcript:
        mt = importlib.import_module("mlx_whisper.transcribe")  # the package's name is the function

        if not self.multilingual:
            language = english_only(self.model_id, language)
        check()
        seconds = len(audio) / 16000
        prefix = prefix.strip() if seconds <= PREFIXED_SECONDS else ""
        forced = {"prefix": prefix, "without_timestamps": True} if prefix else {}
        audio = np.concatenate([audio, np.zeros(int(PAD * 16000), np.float32)])  # context after the speech
        with _LOCK:
            mt.ModelHolder.model, mt.ModelHolder.model_path = self.model, str(self.path)
            self._check = check
            try:
                result = mt.transcribe(
                    audio.astype(np.float32, copy=False),
                    path_or_hf_repo=str(self.path),
                    language=language,
                    fp16=False,
                    verbose=None,
                    condition_on_previous_text=False,
                    # Greedy only, and at most ~8 tokens a second of audio (speech is 2-4): on CPU
                    # a hallucinating window retried at five more temperatures, 224 tokens each,
                    # costs tens of seconds, and a realtime hypothesis must not.
                    temperature=0.0,
                    sample_len=min(224, 16 + int(8 * min(len(audio) / 16000, 30.0))),
                    **forced,
                )
            finally:
                self._check = lambda: None
        cap = int(seconds * 1000) / 1000  # the clip's end (not its added silence's), in whole ms
        segments = tuple(
            Segment(round(min(float(s["start"]), cap), 3), round(min(float(s["end"]), cap), 3), str(s["text"]))
            for s in result.get("segments", ())
            if str(s["text"]).strip()
        )
        text = str(result.get("text", "")).strip()
        if prefix:  # one window, its text after the prefix
            text = f"{prefix} {text}".strip()
            segments = (Segment(0.0, cap, " " + text),)
        return Transcript(text, str(result.get("language") or language or "en"), seconds, segments)
