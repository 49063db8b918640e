"""WAV in and out, mono 16 kHz for the speech models (sans-io).

``decode`` reads RIFF/WAVE (``WAVE_FORMAT_PCM`` 8/16/24/32-bit, ``IEEE_FLOAT`` 32/64-bit, and
``WAVE_FORMAT_EXTENSIBLE`` carrying either), downmixes to mono and resamples to 16 kHz with a
polyphase windowed-sinc filter; ``encode`` writes 16-bit mono PCM.  Every failure is an
``AudioInvalid`` naming what is wrong.
"""

from __future__ import annotations

import struct
from math import gcd

import numpy as np

__all__ = ["SAMPLE_RATE", "AudioInvalid", "NotWav", "decode", "encode", "resample", "to_s16"]

SAMPLE_RATE = 16_000

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE


class AudioInvalid(ValueError):
    """The bytes are WAV but not audio we can read."""


class NotWav(AudioInvalid):
    """The bytes are not a RIFF/WAVE file at all."""


def decode(data: bytes, rate: int = SAMPLE_RATE) -> np.ndarray:
    """The samples of a WAV file as mono float32 in [-1, 1] at ``rate`` Hz."""
    samples, source_rate = read(data)
    return resample(samples, source_rate, rate)


def read(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 samples at the file's own rate, and that rate."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise NotWav("the audio is not a WAV file (RIFF/WAVE); send WAV")
    fmt: tuple[int, int, int, int] | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk == b"fmt ":
            if len(body) < 16:
                raise AudioInvalid("the WAV fmt chunk is truncated")
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
            if tag == _EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]
            fmt = (tag, channels, rate, bits)
        elif chunk == b"data":
            if fmt is None:
                raise AudioInvalid("the WAV data chunk comes before its fmt chunk")
            if size == 0xFFFFFFFF or pos + 8 + size > len(data):  # streamed WAV: to the end
                body = data[pos + 8 :]
            return _samples(body, *fmt), fmt[2]
        pos += 8 + size + (size & 1)
    raise AudioInvalid("the WAV file has no data chunk" if fmt else "the WAV file has no fmt chunk")


def _samples(body: bytes, tag: int, channels: int, rate: int, bits: int) -> np.ndarray:
    if channels < 1 or rate < 1:
        raise AudioInvalid(f"the WAV header says {channels} channels at {rate} Hz")
    width = bits // 8
    if tag == _PCM and bits in (8, 16, 24, 32):
        frame = width * channels
        body = body[: len(body) - len(body) % frame]
        if bits == 8:
            x = (np.frombuffer(body, np.uint8).astype(np.float32) - 128.0) / 128.0
        elif bits == 16:
            x = np.frombuffer(body, "<i2").astype(np.float32) / 32768.0
        elif bits == 24:
            b = np.frombuffer(body, np.uint8).reshape(-1, 3).astype(np.int32)
            v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            v = np.where(v >= 1 << 23, v - (1 << 24), v)
            x = v.astype(np.float32) / float(1 << 23)
        else:
            x = (np.frombuffer(body, "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    elif tag == _FLOAT and bits in (32, 64):
        frame = width * channels
        body = body[: len(body) - len(body) % frame]
        x = np.frombuffer(body, "<f4" if bits == 32 else "<f8").astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise AudioInvalid("the WAV file holds samples that are not finite")
    else:
        kind = {_PCM: "PCM", _FLOAT: "float"}.get(tag, f"format tag {tag:#06x}")
        raise AudioInvalid(f"unsupported WAV encoding: {bits}-bit {kind}; send 8/16/24/32-bit PCM or float")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def resample(x: np.ndarray, source: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """``x`` from ``source`` Hz to ``target`` Hz (polyphase, Kaiser-windowed sinc)."""
    if source == target or len(x) == 0:
        return x.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = gcd(source, target)
    y = resample_poly(x.astype(np.float32), target // g, source // g)
    return y.astype(np.float32)


def to_s16(x: np.ndarray) -> bytes:
    """Float samples as little-endian 16-bit PCM (clipped)."""
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def encode(pcm_s16: bytes, rate: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV file around ``pcm_s16``."""
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", 36 + len(pcm_s16), b"WAVE", b"fmt ", 16, _PCM, channels, rate,
        rate * channels * 2, channels * 2, 16, b"data", len(pcm_s16),
    )  # fmt: skip
    return header + pcm_s16
