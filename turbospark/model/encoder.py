"""What an encoder is (the synchronous interface the embedding thread drives), and the scripted one.

An encoder turns texts into unit vectors.  Like a generation backend it is created, loaded and
used on its model's one pinned OS thread, so nothing here is async and nothing imports Trio:

- ``tokenize(texts, truncate=...)`` gives the token ids the model reads for each text, special
  tokens included; with ``truncate`` they are cut to ``max_tokens`` the way the model's own
  tokenizer cuts them, without it they are whole (the caller refuses what is too long);
- ``embed(batch)`` runs one forward pass over several inputs of token ids (padded to the longest
  and masked, so an input's vector does not depend on its batch-mates) and returns one unit
  vector per input, ``(len(batch), dimensions)`` float32.

``ScriptedEncoder`` is the test encoder: the original server's scripted vector
``normalise([1.0, 0.1 * bytes, 0.5, -0.2])`` (4 dimensions, ``bytes`` the UTF-8 length of the text
it read), token counts from the scripted chat model's real tokenizer, and a record of every
batch it ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import numpy as np

from .. import __version__
from .backend import fingerprint
from .tokenizer import Tokenizer

__all__ = ["EMBEDDING_CONFIG", "SCRIPTED_ENCODER_ID", "Encoder", "EncoderSpec", "ScriptedEncoder"]

#: The file of a stored embedding model that says how its vectors are made (pooling, length).
EMBEDDING_CONFIG = "embedding.json"
SCRIPTED_ENCODER_ID = "scripted-embedding"


class Encoder(Protocol):
    model_id: str
    dimensions: int  #: the width of every vector
    max_tokens: int  #: the longest input the model reads, special tokens included
    fingerprint: str
    vocab_size: int  #: token ids an input given as ids may use: 0 to this, exclusive
    #: Whether its vectors may be cut short (``dimensions``): trained for it (Matryoshka
    #: representation learning) at any width (``True``) or at these widths; ``False``, not at all.
    matryoshka: bool | tuple[int, ...]

    def tokenize(self, texts: Sequence[str], *, truncate: bool) -> list[list[int]]: ...

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray: ...


class ScriptedEncoder:
    """A deterministic 4-dimensional encoder for client tests (no model, no MLX)."""

    dimensions = 4
    #: its vectors keep their order when cut short, as a Matryoshka model's do (the tests of
    #: ``dimensions`` use it)
    matryoshka = True

    def __init__(
        self,
        *,
        model_id: str = SCRIPTED_ENCODER_ID,
        max_tokens: int = 8192,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        from .scripted import shipped_tokenizer

        self.model_id = model_id
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer or shipped_tokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.fingerprint = fingerprint("scripted-embedding", f"turbospark {__version__}")
        #: every forward pass, in order: the token ids of each of its inputs
        self.batches: list[list[list[int]]] = []

    def tokenize(self, texts: Sequence[str], *, truncate: bool) -> list[list[int]]:
        ids = [self.tokenizer.encode(text) for text in texts]
        return [i[: self.max_tokens] for i in ids] if truncate else ids

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        self.batches.append([list(ids) for ids in batch])
        rows = [
            [1.0, 0.1 * len(self.tokenizer.decode(ids).encode()), 0.5, -0.2] for ids in batch
        ]
        vectors = np.array(rows, dtype=np.float64).reshape(len(batch), self.dimensions)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


@attrs.frozen
class EncoderSpec:
    """An embedding model to attach: its id, and how its thread builds the encoder."""

    id: str
    make: Callable[[], Encoder]
