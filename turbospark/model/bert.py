"""A BERT encoder in MLX, for sentence embeddings (all-MiniLM-L6-v2 and its kind).

The model is the plain post-norm BERT of Hugging Face's ``BertModel``: token, position and
token-type embeddings with a LayerNorm, then ``num_hidden_layers`` blocks of multi-head
self-attention and a GELU feed-forward, each followed by a residual LayerNorm.  Padding is masked
out of every attention (a boolean key mask: a padded position gets exactly zero weight), so a
sentence's vector does not depend on what it is batched with, up to float rounding.

``hf_to_mlx`` renames a Hugging Face checkpoint's tensors to this module's names and drops what
sentence embeddings never read (the pooler, ``position_ids``, masked-LM heads); the model store
applies it once, at import, so the runtime loads the stored weights strictly.

Nothing here imports Trio: it runs on the encoder's model thread.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from .. import __version__
from .backend import fingerprint
from .encoder import EMBEDDING_CONFIG

__all__ = ["Bert", "BertConfig", "BertEncoder", "hf_to_mlx", "mean_pool"]


class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` the forward pass needs."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if config.get("model_type") != "bert":
            raise ValueError(f"not a BERT config (model_type {config.get('model_type')!r})")
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'gelu')")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        self.vocab_size = int(config["vocab_size"])
        self.hidden_size = int(config["hidden_size"])
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.intermediate_size = int(config["intermediate_size"])
        self.max_positions = int(config["max_position_embeddings"])
        self.type_vocab_size = int(config.get("type_vocab_size", 2))
        self.eps = float(config.get("layer_norm_eps", 1e-12))


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.positions = nn.Embedding(c.max_positions, c.hidden_size)
        self.token_types = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.eps)

    def __call__(self, ids: mx.array, types: mx.array | None = None) -> mx.array:
        positions = mx.arange(ids.shape[1])
        # one sentence per row: every token has type 0; a pair's second text has type 1
        kind = self.token_types.weight[0] if types is None else self.token_types(types)
        x = self.tokens(ids) + self.positions(positions)[None] + kind
        return self.norm(x)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.out = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        h = self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=(d // h) ** -0.5, mask=mask)
        x = self.norm1(x + self.out(a.transpose(0, 2, 1, 3).reshape(b, n, d)))
        return self.norm2(x + self.down(nn.gelu(self.up(x))))


class Bert(nn.Module):
    """``labels`` > 0: ``BertForSequenceClassification``'s head too (the pooler's tanh dense
    layer over the first token, then a linear classifier), read by ``classify``."""

    def __init__(self, config: BertConfig, labels: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.layers = [_Layer(config) for _ in range(config.layers)]
        if labels:
            self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
            self.classifier = nn.Linear(config.hidden_size, labels)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        """Hidden states ``(batch, length, hidden)`` of right-padded ``ids``; ``mask`` (batch,
        length) is true on real tokens, false on padding; ``types`` the token types (all 0
        when None)."""
        keys = mask[:, None, None, :]  # every query attends to the real tokens only
        x = self.embeddings(ids, types)
        for layer in self.layers:
            x = layer(x, keys)
        return x

    def classify(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        """The classifier's logits ``(batch, labels)``."""
        first = self(ids, mask, types)[:, 0]
        return self.classifier(mx.tanh(self.pooler(first)))


def mean_pool(hidden: mx.array, mask: mx.array) -> mx.array:
    """Sentence-transformers' mean pooling over real tokens, then L2 normalisation."""
    weights = mask[..., None].astype(hidden.dtype)
    mean = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
    return mean / mx.linalg.norm(mean, axis=-1, keepdims=True)


_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
_IN_LAYER = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "norm2",
}
_EMBEDDINGS = {
    "word_embeddings": "tokens",
    "position_embeddings": "positions",
    "token_type_embeddings": "token_types",
    "LayerNorm": "norm",
}


def _rename(name: str, classifier: bool = False) -> str | None:
    """This module's name for a Hugging Face BERT tensor; None for what embeddings never read
    (the pooler and classifier are kept for a ``classifier``)."""
    name = name.removeprefix("bert.")
    module, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # older checkpoints' LayerNorms
    if classifier and module in ("pooler.dense", "classifier"):
        return f"{module.removesuffix('.dense')}.{leaf}"
    if module.startswith("embeddings."):
        part = module.removeprefix("embeddings.")
        return f"embeddings.{_EMBEDDINGS[part]}.{leaf}" if part in _EMBEDDINGS else None
    if m := _LAYER.fullmatch(module):
        index, part = m.groups()
        return f"layers.{index}.{_IN_LAYER[part]}.{leaf}" if part in _IN_LAYER else None
    return None  # pooler, position_ids, cls.* (masked-LM heads)


def hf_to_mlx(weights: Mapping[str, mx.array], *, classifier: bool = False) -> dict[str, mx.array]:
    """A Hugging Face BERT checkpoint's tensors under this module's names (unused ones dropped;
    ``classifier``: a ``BertForSequenceClassification``, its pooler and classifier kept)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if (renamed := _rename(name, classifier)) is not None:
            out[renamed] = value
    return out


class BertEncoder:
    """The ``Encoder`` of a stored BERT sentence-embedding model (see ``encoder.Encoder``), or of
    a cross-encoder (``embedding.json`` ``pooling`` ``classifier``: a
    ``BertForSequenceClassification`` with one label), which scores (query, document) pairs.

    The directory holds ``config.json``, ``model.safetensors`` (this module's names, written by
    the store), ``tokenizer.json`` and ``embedding.json`` (``pooling``, ``normalize``,
    ``max_tokens``, and ``matryoshka`` where the model was trained for truncated vectors).  Build it on the thread that will use it: its MLX stream is that thread's.
    """

    def __init__(self, path: Path, *, model_id: str) -> None:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        spec = json.loads((path / EMBEDDING_CONFIG).read_text())
        self.cross = spec.get("pooling") == "classifier"
        if not self.cross and (spec.get("pooling") != "mean" or spec.get("normalize") is not True):
            raise ValueError(f"unsupported pooling {spec!r}: only normalised mean pooling or a classifier")
        if self.cross and spec.get("labels") != 1:
            raise ValueError(f"a cross-encoder with {spec.get('labels')} labels: only one is supported")
        self.model_id = model_id
        bert = BertConfig(config)
        self.dimensions = 1 if self.cross else bert.hidden_size
        self.max_tokens = min(int(spec["max_tokens"]), bert.max_positions)
        widths = spec.get("matryoshka", False)
        self.matryoshka: bool | tuple[int, ...] = tuple(widths) if isinstance(widths, list) else bool(widths)
        self.stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(self.stream):
            self.model = Bert(bert, labels=1 if self.cross else 0)
            self.model.load_weights(str(path / "model.safetensors"), strict=True)
            self.model.eval()
            mx.eval(self.model.parameters())
        self._whole = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        self._whole.no_padding()
        self._whole.no_truncation()
        self.vocab_size = self._whole.get_vocab_size(with_added_tokens=True)
        self._cut = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        self._cut.no_padding()
        self._cut.enable_truncation(self.max_tokens)
        self._sep = self._whole.token_to_id("[SEP]")
        digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
        self.fingerprint = fingerprint(digest, f"turbospark {__version__}", f"mlx {mx.__version__}")

    def tokenize(self, texts: Sequence[str], *, truncate: bool) -> list[list[int]]:
        tok = self._cut if truncate else self._whole
        return [e.ids for e in tok.encode_batch(list(texts))]

    def tokenize_pairs(self, query: str, documents: Sequence[str], *, truncate: bool) -> list[list[int]]:
        """``[CLS] query [SEP] document [SEP]`` for each document (cut longest first)."""
        tok = self._cut if truncate else self._whole
        return [e.ids for e in tok.encode_batch([(query, d) for d in documents])]

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit vectors ``(len(batch), dimensions)``; a cross-encoder's relevance of each pair
        instead, its one logit through a sigmoid (sentence-transformers' ``CrossEncoder``)."""
        longest = max(len(ids) for ids in batch)
        ids = np.zeros((len(batch), longest), dtype=np.int32)
        mask = np.zeros((len(batch), longest), dtype=np.bool_)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = True
        with mx.stream(self.stream):
            m = mx.array(mask)
            if self.cross:  # type 1 after the first [SEP]: the document
                types = (np.cumsum(ids == self._sep, axis=1) - (ids == self._sep)) > 0
                logits = self.model.classify(mx.array(ids), m, mx.array(types.astype(np.int32)))
                return np.array(mx.sigmoid(logits).astype(mx.float32))
            vectors = mean_pool(self.model(mx.array(ids), m), m)
            return np.array(vectors.astype(mx.float32))
