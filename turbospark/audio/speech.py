"""Text-to-speech engines: Piper (a neural voice on onnxruntime) and espeak-ng (Debian's
formant synthesiser, tiny and deterministic, run as a program)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .engines import Check, Task, _sentences
from .wav import read, to_s16

__all__ = ["ESPEAK_ID", "EspeakTextToSpeech", "PiperTextToSpeech", "espeak_available"]

ESPEAK_ID = "espeak-ng"
VOICE_FILE = "voice.onnx"


class PiperTextToSpeech:
    task: Task = "text_to_speech"

    def __init__(self, path: Path, *, model_id: str) -> None:
        from piper import PiperVoice

        self.model_id = model_id
        path = Path(path)
        self.voice = PiperVoice.load(path / VOICE_FILE, config_path=path / (VOICE_FILE + ".json"))
        self.sample_rate = int(self.voice.config.sample_rate)
        config = json.loads((path / (VOICE_FILE + ".json")).read_text())
        name = (config.get("dataset") or model_id).split("-")[0] or model_id
        self.voices: tuple[str, ...] = (name,)
        list(self.synthesize("Ready.", name, 1.0, lambda: None))  # warm onnxruntime up

    def synthesize(self, text: str, voice: str, speed: float, check: Check) -> Iterator[bytes]:
        from piper.config import SynthesisConfig

        base = self.voice.config.length_scale or 1.0
        config = SynthesisConfig(length_scale=base / speed)
        for sentence in _sentences(text):  # one sentence per step, so a leaving client stops it
            check()
            for chunk in self.voice.synthesize(sentence, syn_config=config):
                yield chunk.audio_int16_bytes


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


class EspeakTextToSpeech:
    task: Task = "text_to_speech"
    sample_rate = 22_050

    def __init__(self, *, model_id: str = ESPEAK_ID) -> None:
        self.model_id = model_id
        self.program = shutil.which("espeak-ng")
        if self.program is None:
            raise RuntimeError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
        self.voices = ("en-us", "en", "en-gb", "de", "fr", "es", "it")

    def synthesize(self, text: str, voice: str, speed: float, check: Check) -> Iterator[bytes]:
        for sentence in _sentences(text):
            check()
            out = subprocess.run(
                [self.program, "--stdout", "-v", voice, "-s", str(round(175 * speed)), sentence],
                capture_output=True, check=True, timeout=60,
            )  # fmt: skip
            samples, rate = read(out.stdout)
            if rate != self.sample_rate:
                from .wav import resample

                samples = resample(samples, rate, self.sample_rate)
            yield to_s16(samples.astype(np.float32))
