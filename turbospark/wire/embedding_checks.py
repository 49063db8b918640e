"""Embedding requests and answers, without I/O: the limits, the checks in the original server's
order with its messages, ``dimensions`` truncation, and the float and base64 encodings.

Shared by the OpenAI route (``/v1/embeddings``) and the Ollama ones (``/api/embed``,
``/api/embeddings``); every failure is one ``RequestInvalid`` (a 400 in the caller's family).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import RequestInvalid

__all__ = [
    "ENCODING_FORMATS",
    "MAX_INPUTS",
    "MAX_INPUT_BYTES",
    "check_dimensions",
    "check_encoding_format",
    "check_inputs",
    "encode_vector",
    "inputs_of",
    "shorten",
]

MAX_INPUTS = 2048
MAX_INPUT_BYTES = 1 << 20
ENCODING_FORMATS = ("float", "base64")


def inputs_of(value: Any, field: str = "input", *, ids: bool = False) -> list[str | tuple[int, ...]]:
    """The inputs of an ``input`` field: a string or an array of strings; with ``ids`` (OpenAI's
    spec) also an array of token ids (one input) or an array of such arrays, strings and arrays
    mixed (the ids are checked against the model's vocabulary by the encoder thread)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value  # type: ignore[return-value]
    tokens = isinstance(value, list) and value and all(
        _is_int(v) or (isinstance(v, list) and all(_is_int(t) for t in v)) for v in value)
    if ids and isinstance(value, list) and value:
        if all(_is_int(v) for v in value):
            return [tuple(value)]
        if all(isinstance(v, str) or (isinstance(v, list) and all(_is_int(t) for t in v)) for v in value):
            return [v if isinstance(v, str) else tuple(v) for v in value]
    if tokens:
        raise RequestInvalid(
            f"{field} as token ids is not supported: this model reads text with its own "
            "tokenizer; send strings",
            param=field,
        )
    if ids:
        raise RequestInvalid(
            f"{field} must be a string, an array of strings, an array of token ids or an array of such arrays",
            param=field)
    raise RequestInvalid(f"{field} must be a string or an array of strings", param=field)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_encoding_format(value: str | None) -> str:
    fmt = "float" if value is None else value
    if fmt not in ENCODING_FORMATS:
        raise RequestInvalid(f'encoding_format must be float or base64, not "{fmt}"', param="encoding_format")
    return fmt


def check_inputs(inputs: Sequence[str | tuple[int, ...]], *, field: str = "input", allow_empty: bool = False) -> None:
    """At least one input (unless ``allow_empty``), at most ``MAX_INPUTS``, at most
    ``MAX_INPUT_BYTES`` of UTF-8 in all (a token id counts 4 bytes)."""
    if not inputs and not allow_empty:
        raise RequestInvalid(f"{field} must not be empty", param=field)
    if len(inputs) > MAX_INPUTS:
        raise RequestInvalid(
            f"too many inputs: {len(inputs)} exceeds the {MAX_INPUTS}-item limit", param=field
        )
    size = 0
    for i, text in enumerate(inputs):
        if not isinstance(text, str):
            size += 4 * len(text)
            continue
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise RequestInvalid(f"{field} {i} is not valid Unicode (a lone surrogate)", param=field) from None
    if size > MAX_INPUT_BYTES:
        raise RequestInvalid(
            f"input too large: {size} bytes exceeds the {MAX_INPUT_BYTES}-byte limit", param=field
        )


def check_dimensions(
    dimensions: int | None, width: int | None = None, matryoshka: bool | tuple[int, ...] = True, model: str = ""
) -> None:
    """``dimensions`` is positive, and (once the model is known) at most its ``width``; short of
    that width only for a model trained for truncated vectors (``matryoshka``: any width, or
    these), as vLLM has it: another's cut vectors would be poor, and a 400 says so."""
    if dimensions is None:
        return
    if dimensions <= 0:
        raise RequestInvalid(f"dimensions must be greater than 0, got {dimensions}", param="dimensions")
    if width is None:
        return
    if dimensions > width:
        raise RequestInvalid(
            f"dimensions {dimensions} exceeds this model's own width of {width}", param="dimensions"
        )
    if dimensions == width or matryoshka is True:
        return
    if not matryoshka:
        raise RequestInvalid(
            f"model {model!r} does not support dimensions: it was not trained for truncated vectors"
            f" (Matryoshka representation), so only its own width of {width} is accepted",
            param="dimensions",
        )
    if dimensions not in matryoshka:
        widths = ", ".join(map(str, matryoshka))
        raise RequestInvalid(
            f"model {model!r} supports dimensions of {widths} (or its own width of {width}), got {dimensions}",
            param="dimensions",
        )


def shorten(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Each vector cut to its first ``dimensions`` values and L2-renormalised (as OpenAI's
    ``text-embedding-3`` models do); unchanged without ``dimensions`` or at full width."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions].astype(np.float64)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return (cut / norms).astype(np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """A vector on the wire: its float32 values, written as JSON numbers (each value exactly:
    ``json_worker.dumps`` writes an array as its list), or base64 of its little-endian float32
    bytes.  Kept an array until written, so a big answer is never a list of Python floats on
    the event loop."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32)
