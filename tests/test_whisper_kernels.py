"""Whisper on turbospark's CPU kernels (decision 0045): the encoder and decoder through 8-bit
products, the kernels' attention and GELU, against mlx-whisper's own float32 layers on the same
model and spoken clips."""

from __future__ import annotations

import difflib

import numpy as np
import pytest

from .realmodels import piper_store, whisper_store
from .test_whisper_window import SENTENCES, spoken, window, words

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def engines():  # type: ignore[no-untyped-def]
    pytest.importorskip("mlx_whisper")
    pytest.importorskip("piper")
    from turbospark.audio import whisper
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.kernels import ops

    if not ops.available():
        pytest.skip("turbospark's CPU kernels are not built")
    stt, tts = whisper_store(), piper_store()
    fast = whisper.WhisperSpeechToText(stt.path, model_id=stt.name)
    own = whisper._on_kernels
    whisper._on_kernels = lambda model: None  # as where the kernels are not built
    try:
        plain = whisper.WhisperSpeechToText(stt.path, model_id=stt.name)
    finally:
        whisper._on_kernels = own
    return fast, plain, PiperTextToSpeech(tts.path, model_id=tts.name)


def test_the_layers_run_through_the_kernels_and_keep_mlx_whispers_numbers(engines) -> None:  # type: ignore[no-untyped-def]
    import mlx.core as mx

    from turbospark.audio.whisper_kernels import KernelWhisper

    fast, plain, tts = engines
    assert fast.fast is not None and plain.fast is None
    mel = window(spoken(tts, SENTENCES[0]))
    theirs = plain.model.encoder(mel)
    assert fast.model.encoder(mel).shape == theirs.shape
    for bits, within in ((16, 1e-3), (8, 0.05)):  # float16 weights: the store's own; 8 bits: x and W rounded
        ours = KernelWhisper(plain.model, bits)
        features = ours.encode(mel[:, : 2 * theirs.shape[1]])
        assert features.shape == theirs.shape
        assert mx.mean(mx.abs(features - theirs)).item() <= within * mx.mean(mx.abs(theirs)).item()
        # the decoder: the prompt's logits, then a step on its cache, pick what mlx-whisper's pick
        prompt = mx.array([[50257, 50362]])
        want, cache, _ = plain.model.decoder._part(prompt, theirs)
        got, kv, cross = ours.decoder(prompt, theirs)
        assert got.shape == want.shape and len(kv) == len(cross) == 4
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1))
        step = mx.argmax(want[:, -1:], -1)
        want, _, _ = plain.model.decoder._part(step, theirs, cache)
        got, kv, _ = ours.decoder(step, theirs, kv)
        assert kv[0][0][0].shape[2] == 3  # three positions' keys, split into heads
        assert mx.argmax(got, -1).item() == mx.argmax(want, -1).item()


def test_its_transcripts_are_mlx_whispers(engines) -> None:  # type: ignore[no-untyped-def]
    fast, plain, tts = engines
    clips = [np.concatenate([spoken(tts, s), np.zeros(8000, np.float32)]) for s in SENTENCES]
    clips.append(clips[-1][: len(clips[-1]) * 6 // 10])  # cut while the speaker talks: the whole window
    ours = [fast.transcribe(c, "en", lambda: None).text for c in clips]
    theirs = [plain.transcribe(c, "en", lambda: None).text for c in clips]
    # the same words on 21 clips in decision 0045's study; here, each clip's within a word or two
    for mine, plain_text in zip(ours, theirs, strict=True):
        assert difflib.SequenceMatcher(None, words(mine), words(plain_text)).ratio() >= 0.85, (ours, theirs)
    assert all(ours)
