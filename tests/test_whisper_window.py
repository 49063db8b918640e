"""Whisper's encoder reads the audio there is (decisions 0044, 0045): a window's clip, half a
second of silence and seven seconds of its padding instead of the whole 30 seconds, with the full
window's transcript."""

from __future__ import annotations

import difflib
import re

import numpy as np
import pytest

from .realmodels import piper_store, whisper_store

pytestmark = pytest.mark.mlx

SENTENCES = (
    "What is the capital of France?",
    "Please turn off the lights in the kitchen.",
    "Explain the difference between a virus and a bacterium in simple words.",
)


@pytest.fixture(scope="module")
def engines():  # type: ignore[no-untyped-def]
    pytest.importorskip("mlx_whisper")
    pytest.importorskip("piper")
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.audio.whisper import WhisperSpeechToText

    stt, tts = whisper_store(), piper_store()
    return WhisperSpeechToText(stt.path, model_id=stt.name), PiperTextToSpeech(tts.path, model_id=tts.name)


def spoken(tts, text: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    pcm = np.frombuffer(b"".join(tts.synthesize(text, tts.voices[0], 1.0, lambda: None)), np.int16)
    pcm = pcm.astype(np.float32) / 32768
    n = len(pcm) * 16000 // tts.sample_rate
    return np.interp(np.arange(n) * tts.sample_rate / 16000, np.arange(len(pcm)), pcm).astype(np.float32)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


def window(audio: np.ndarray):  # type: ignore[no-untyped-def]
    """The first window's mel as ``mlx_whisper.transcribe`` gives the encoder (batch of one)."""
    from mlx_whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim

    mel = log_mel_spectrogram(audio, padding=N_SAMPLES)
    return pad_or_trim(mel[: min(N_FRAMES, len(audio) // 160)], N_FRAMES, axis=-2)[None]


def filled(mel) -> int:  # type: ignore[no-untyped-def]
    """The frames of a window that are not ``pad_or_trim``'s zeros."""
    import mlx.core as mx

    return int(np.flatnonzero(np.asarray(mx.max(mx.abs(mel), axis=(0, 2))))[-1]) + 1


def test_the_encoder_reads_the_clip_half_a_second_and_seven_seconds_of_padding(engines) -> None:  # type: ignore[no-untyped-def]
    from turbospark.audio.whisper import MARGIN, PAD

    stt, tts = engines
    audio = spoken(tts, SENTENCES[0])
    frames = len(audio) // 160
    assert 100 < frames < 400  # about two seconds
    features = stt.model.encoder(window(audio))
    assert features.shape == (1, (frames + MARGIN + 1) // 2, stt.model.dims.n_audio_state)
    # a whole window of speech (30 s, no padding): every position, as before
    long = np.tile(audio, 3000 // frames + 1)[: 30 * 16000]
    assert stt.model.encoder(window(long)).shape[1] == stt.model.dims.n_audio_ctx
    # a clip, here one cut while the speaker talks, is heard with PAD seconds of silence after it
    read: list[int] = []
    encoder = stt.model.encoder
    stt.model.encoder = lambda mel: read.append(filled(mel)) or encoder(mel)
    try:
        cut = audio[: len(audio) * 6 // 10]
        transcript = stt.transcribe(cut, "en", lambda: None)
    finally:
        stt.model.encoder = encoder
    assert len(read) == 1 and abs(read[0] - (len(cut) // 160 + int(PAD * 100))) <= 2, read  # the clip and PAD
    assert transcript.duration == len(cut) / 16000  # told as the clip's
    assert transcript.text and all(s.end <= transcript.duration for s in transcript.segments)


def test_its_transcripts_are_the_full_windows(engines) -> None:  # type: ignore[no-untyped-def]
    from turbospark.audio import whisper

    stt, tts = engines
    # Piper's noise differs call to call: one clip each, with the half second of silence that ends
    # a realtime turn (server VAD)
    clips = [np.concatenate([spoken(tts, s), np.zeros(8000, np.float32)]) for s in SENTENCES]
    fitted = [stt.transcribe(c, "en", lambda: None).text for c in clips]
    encoder = stt.model.encoder
    stt.model.encoder = whisper._Checked(encoder._part, stt)
    try:
        full = [stt.transcribe(c, "en", lambda: None).text for c in clips]
    finally:
        stt.model.encoder = encoder
    for ours, theirs in zip(fitted, full, strict=True):  # a word here or there (decision 0045: the same error rate)
        assert difflib.SequenceMatcher(None, words(ours), words(theirs)).ratio() >= 0.85, (fitted, full)
    for text, meant in zip(fitted, SENTENCES, strict=True):  # Whisper tiny's slips aside ("Police set")
        said = difflib.SequenceMatcher(None, re.sub(r"[^a-z]", "", text.lower()), re.sub(r"[^a-z]", "", meant.lower()))
        assert said.ratio() >= 0.8, (text, meant)


def test_a_prefix_is_decoded_from_and_the_rest_transcribed(engines) -> None:  # type: ignore[no-untyped-def]
    """A realtime session's given words as the decoder's forced prefix: the transcript starts with
    them, as written, and goes on with the clip's other words, one segment, nothing heard twice."""
    stt, tts = engines
    clip = spoken(tts, SENTENCES[2])
    plain = stt.transcribe(clip, "en", lambda: None)
    given = " ".join(plain.text.split()[:4])
    decoded = stt.transcribe(clip, "en", lambda: None, prefix=given)
    assert decoded.text.startswith(given + " ")
    assert difflib.SequenceMatcher(None, words(decoded.text), words(plain.text)).ratio() >= 0.85, (decoded, plain)
    assert len(words(decoded.text)) <= len(words(plain.text)) + 2
    assert [(s.start, s.text) for s in decoded.segments] == [(0.0, " " + decoded.text)]
    assert decoded.segments[0].end == pytest.approx(len(clip) / 16000, abs=0.001)
