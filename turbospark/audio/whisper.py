"""Whisper on MLX (``mlx-whisper``), from a model directory in the store.

``mlx_whisper.transcribe`` does the windowing, the decoding with temperature fallback and the
segmenting; this wraps it so that a job's ``check`` runs before the encoder and before every
decoder step (a client that leaves stops its transcription within one step).  ``mlx_whisper``
keeps its model in a process-wide holder keyed by path, so transcriptions are serialised by one
lock: the thread holding it puts its own model there first.
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


class _Checked:
    """A model part that runs the current job's ``check`` before every call."""

    def __init__(self, part: Any, owner: WhisperSpeechToText) -> None:
        self._part, self._owner = part, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._owner._check()
        return self._part(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._part, name)


class WhisperSpeechToText:
    task: Task = "speech_to_text"

    def __init__(self, path: Path, *, model_id: str) -> None:
        import mlx.core as mx
        from mlx_whisper.load_models import load_model

        self.model_id = model_id
        self.path = Path(path)
        self.model = load_model(str(self.path), dtype=mx.float32)
        self.multilingual = self.model.is_multilingual
        # Checks inside the model: before the encoder and before each decoder step.
        self.model.encoder = _Checked(self.model.encoder, self)
        self.model.decoder = _Checked(self.model.decoder, self)
        self._check: Check = lambda: None
        self._warm()

    def _warm(self) -> None:
        """One short transcription, so the first request does not pay for MLX's first calls."""
        self.transcribe(np.zeros(1600, np.float32), "en", lambda: None)

    def transcribe(self, audio: np.ndarray, language: str | None, check: Check) -> Transcript:
        mt = importlib.import_module("mlx_whisper.transcribe")  # the package's name is the function

        if not self.multilingual:
            language = english_only(self.model_id, language)
        check()
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
                )
            finally:
                self._check = lambda: None
        segments = tuple(
            Segment(round(float(s["start"]), 3), round(float(s["end"]), 3), str(s["text"]))
            for s in result.get("segments", ())
            if str(s["text"]).strip()
        )
        text = str(result.get("text", "")).strip()
        return Transcript(text, str(result.get("language") or language or "en"), len(audio) / 16000, segments)
