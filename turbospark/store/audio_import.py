"""Audio models into the store: Whisper from CTranslate2, Piper voices as they are.

**Whisper (CTranslate2 → mlx-whisper).**  faster-whisper's ``model.bin`` is read directly
(no ``ctranslate2`` package): a u32 binary version, the spec name and revision, then per variable
its name, rank, dims, dtype, byte count and bytes, then aliases.  The converter splits the fused
self-attention QKV and cross-attention KV (Whisper's key projection has no bias: its slice of the
fused bias is zero and dropped), renames to mlx-whisper's names, turns the conv weights from
(out, in, k) to MLX's (out, k, in), drops the encoder's sinusoidal positions (mlx-whisper computes
them) and writes ``weights.safetensors`` in float32 (MLX's CPU matmul uses BLAS for float32 only)
and ``config.json`` (``ModelDimensions``).  The tokenizer is mlx-whisper's own tiktoken files.

**Piper voices** are an ONNX file and its JSON config, copied as ``voice.onnx(.json)``.

Both get a manifest with ``kind`` ``speech-to-text`` or ``text-to-speech``, and are moved into the
store's directory the way every import is (:meth:`StoreDirectory.install`).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .directory import StoreDirectory, StoredModel
from .gguf_import import ModelImportError
from .hashing import files_digest
from .manifest import new_manifest
from .progress import Progress, progress_from

__all__ = [
    "AUDIO_KINDS",
    "STT_KIND",
    "TTS_KIND",
    "audio_sha256",
    "convert_ct2_whisper",
    "copy_piper_voice",
    "import_audio",
    "read_ct2",
]

STT_KIND = "speech-to-text"
TTS_KIND = "text-to-speech"
AUDIO_KINDS = (STT_KIND, TTS_KIND)

# CTranslate2's DataType ids
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """The spec name and the variables (aliases resolved) of a CTranslate2 ``model.bin``."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string() -> str:
        nonlocal pos
        n = take("H")
        text = data[pos : pos + n - 1].decode()
        pos += n
        return text

    try:
        version = take("I")
        if version < 5:
            raise ModelImportError(f"{path}: CTranslate2 binary version {version} is too old (need 5 or 6)")
        spec = string()
        take("I")  # revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("I")):
            name = string()
            rank = take("B")
            dims = [take("I") for _ in range(rank)]
            dtype, nbytes = take("B"), take("I")
            if dtype not in _DTYPES:
                raise ModelImportError(f"{path}: variable {name} has CTranslate2 dtype {dtype}, which is not supported")
            array = np.frombuffer(data, _DTYPES[dtype], count=nbytes // np.dtype(_DTYPES[dtype]).itemsize, offset=pos)
            variables[name] = array.reshape(dims)
            pos += nbytes
        for _ in range(take("I")):
            alias, target = string(), string()
            variables[alias] = variables[target]
    except struct.error as exc:
        raise ModelImportError(f"{path} is truncated or not a CTranslate2 model ({exc})") from None
    return spec, variables


def _attention(out: dict[str, np.ndarray], src: str, dst: str, v: dict[str, np.ndarray], cross: bool) -> None:
    d = v[f"{src}/linear_0/weight"].shape[1]
    if cross:
        out[f"{dst}.query.weight"] = v[f"{src}/linear_0/weight"]
        out[f"{dst}.query.bias"] = v[f"{src}/linear_0/bias"]
        kv_w, kv_b = v[f"{src}/linear_1/weight"], v[f"{src}/linear_1/bias"]
        out[f"{dst}.key.weight"], out[f"{dst}.value.weight"] = kv_w[:d], kv_w[d:]
        out[f"{dst}.value.bias"] = kv_b[d:]
        proj = "linear_2"
    else:
        qkv_w, qkv_b = v[f"{src}/linear_0/weight"], v[f"{src}/linear_0/bias"]
        out[f"{dst}.query.weight"], out[f"{dst}.key.weight"], out[f"{dst}.value.weight"] = qkv_w[:d], qkv_w[d : 2 * d], qkv_w[2 * d :]
        out[f"{dst}.query.bias"], out[f"{dst}.value.bias"] = qkv_b[:d], qkv_b[2 * d :]
        proj = "linear_1"
    out[f"{dst}.out.weight"] = v[f"{src}/{proj}/weight"]
    out[f"{dst}.out.bias"] = v[f"{src}/{proj}/bias"]


def _norm(out: dict[str, np.ndarray], src: str, dst: str, v: dict[str, np.ndarray]) -> None:
    out[f"{dst}.weight"], out[f"{dst}.bias"] = v[f"{src}/gamma"], v[f"{src}/beta"]


def _block(out: dict[str, np.ndarray], src: str, dst: str, v: dict[str, np.ndarray], *, cross: bool) -> None:
    """One transformer block: self-attention, then (in the decoder, ``cross``) attention over the
    audio, then the MLP; each with its layer norm."""
    _attention(out, f"{src}/self_attention", f"{dst}.attn", v, cross=False)
    _norm(out, f"{src}/self_attention/layer_norm", f"{dst}.attn_ln", v)
    if cross:
        _attention(out, f"{src}/attention", f"{dst}.cross_attn", v, cross=True)
        _norm(out, f"{src}/attention/layer_norm", f"{dst}.cross_attn_ln", v)
    _norm(out, f"{src}/ffn/layer_norm", f"{dst}.mlp_ln", v)
    for a, b in (("linear_0", "mlp1"), ("linear_1", "mlp2")):
        out[f"{dst}.{b}.weight"], out[f"{dst}.{b}.bias"] = v[f"{src}/ffn/{a}/weight"], v[f"{src}/ffn/{a}/bias"]


def _layers(v: dict[str, np.ndarray], side: str) -> int:
    return len({k.split("/")[1] for k in v if re.match(rf"{side}/layer_\d+/", k)})


def convert_ct2_whisper(src: Path, out_dir: Path) -> dict[str, Any]:
    """Convert faster-whisper directory ``src`` (``model.bin``, ``config.json``) into an
    mlx-whisper directory ``out_dir``; returns its config."""
    model_bin = src / "model.bin"
    if not model_bin.is_file():
        raise ModelImportError(f"{src} has no model.bin (a CTranslate2 Whisper model)")
    spec, v = read_ct2(model_bin)
    if spec != "WhisperSpec":
        raise ModelImportError(f"{model_bin} is a CTranslate2 {spec}, not a Whisper model")
    w: dict[str, np.ndarray] = {}
    w["encoder.conv1.weight"] = v["encoder/conv1/weight"].transpose(0, 2, 1)
    w["encoder.conv1.bias"] = v["encoder/conv1/bias"]
    w["encoder.conv2.weight"] = v["encoder/conv2/weight"].transpose(0, 2, 1)
    w["encoder.conv2.bias"] = v["encoder/conv2/bias"]
    n_enc, n_dec = _layers(v, "encoder"), _layers(v, "decoder")
    for i in range(n_enc):
        _block(w, f"encoder/layer_{i}", f"encoder.blocks.{i}", v, cross=False)
    _norm(w, "encoder/layer_norm", "encoder.ln_post", v)
    w["decoder.token_embedding.weight"] = v["decoder/embeddings/weight"]
    w["decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
    for i in range(n_dec):
        _block(w, f"decoder/layer_{i}", f"decoder.blocks.{i}", v, cross=True)
    _norm(w, "decoder/layer_norm", "decoder.ln", v)
    vocab, state = v["decoder/embeddings/weight"].shape
    config = {
        "model_type": "whisper",
        "n_mels": int(v["encoder/conv1/weight"].shape[1]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(v["encoder/conv1/weight"].shape[0]),
        "n_audio_head": int(v["encoder/num_heads"]),
        "n_audio_layer": n_enc,
        "n_vocab": int(vocab),
        "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(state),
        "n_text_head": int(v["decoder/num_heads"]),
        "n_text_layer": n_dec,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "weights.safetensors"), {k: mx.array(a.astype(np.float32)) for k, a in w.items()}
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("tokenizer.json", "vocabulary.txt"):
        if (src / extra).is_file():
            shutil.copy2(src / extra, out_dir / extra)
    return config


def copy_piper_voice(src: Path, out_dir: Path) -> dict[str, Any]:
    """Copy the Piper voice in ``src`` (one ``*.onnx`` and its ``.onnx.json``) into ``out_dir``."""
    voices = sorted(src.glob("*.onnx"))
    if len(voices) != 1 or not voices[0].with_name(voices[0].name + ".json").is_file():
        raise ModelImportError(f"{src} must hold one Piper voice: X.onnx and X.onnx.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(voices[0], out_dir / "voice.onnx")
    config = json.loads(voices[0].with_name(voices[0].name + ".json").read_text())
    shutil.copy2(voices[0].with_name(voices[0].name + ".json"), out_dir / "voice.onnx.json")
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix not in (".onnx", ".json"):
            shutil.copy2(extra, out_dir / extra.name)
    return config


def audio_sha256(directory: Path, *, progress: bool | Progress = False) -> str:
    """A digest of every file in ``directory``: the sha256 of each name and content digest, in name order."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    return files_digest(files, progress=progress_from(progress))


def import_audio(
    store: StoreDirectory,
    source: Path,
    *,
    kind: str,
    name: str,
    label: str,
    sha256: str,
    extra_files: Sequence[Path] = (),
) -> StoredModel:
    """Convert (Whisper) or copy (Piper) ``source`` into ``store`` as model ``name``."""
    with store.scratch() as work:
        model_dir = work / "model"
        if kind == STT_KIND:
            config = convert_ct2_whisper(source, model_dir)
            fmt, architecture, dtype, context = "ctranslate2", "whisper", "float32", config["n_text_ctx"]
        elif kind == TTS_KIND:
            config = copy_piper_voice(source, model_dir)
            fmt, architecture, dtype, context = "onnx", "piper", "native", None
        else:
            raise ModelImportError(f"unknown audio model kind {kind!r}")
        manifest = new_manifest(
            name=name, source=label, sha256=sha256, fmt=fmt, architecture=architecture, dtype=dtype,
            context_length=context, kind=kind,
        )  # fmt: skip
        return store.install(model_dir, manifest, extra_files=extra_files)
