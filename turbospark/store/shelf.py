"""The model store as the server sees it: what may be loaded (the resolver's library), and what
the management routes do to it (pull, copy, delete).

Every stored chat or completion model is ``Loadable``; what is known before loading it comes
from its directory: capabilities (a chat template makes it a chat model), context window,
weights size and parameter count (from the safetensors headers), and Ollama's card for
``/api/show`` (template, sampling parameters, ``model_info``).  How a model is loaded is not the
store's to know: whoever builds the shelf (``cli/attach.py``) hands it the loader, a callable that
builds the backend from a model directory and the model's id.  Everything here is blocking file
work: the resolver and the routes call it on a worker thread.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..actors.lifecycle import Loadable, ModelCard
from ..actors.registry import Capability
from .catalogue import CATALOGUE
from .directory import StoredModel
from .progress import Progress, Report
from .pull import pull
from .store import ModelStore

__all__ = ["Loader", "StoreShelf", "loadable_from", "parameter_size"]

#: ``load(path, model_id)``: the backend for the model in directory ``path``, built on its model
#: thread (``cli/attach.py``'s ``load_mlx``).
Loader = Callable[[Path, str], Any]


class StoreShelf:
    """The store as the resolver's library (``loadables``) and the management routes' target."""

    def __init__(self, store: ModelStore, load: Loader) -> None:
        self.store = store
        self.load = load

    def loadables(self) -> list[Loadable]:
        out = []
        for stored in self.store.list():
            if stored.kind != "generation":
                continue
            try:
                out.append(loadable_from(stored, self.load))
            except (OSError, ValueError, KeyError):
                continue  # a model directory it cannot read is not offered
        return out

    def can_pull(self, name: str) -> bool:
        return name in CATALOGUE

    def digest(self, name: str) -> str:
        entry = CATALOGUE[name]
        return entry.gguf_sha256 or entry.directory_sha256

    def catalogue(self) -> list[str]:
        return list(CATALOGUE)

    def pull(self, name: str, report: Report) -> str:
        """Pull the catalogue model ``name``; its digest.  ``report`` hears how far it is."""
        stored = pull(name, self.store, progress=Progress(report=report))
        return str(stored.manifest.get("source_sha256", ""))

    def delete(self, name: str) -> bool:
        return bool(self.store.remove(name))

    def copy(self, source: str, destination: str) -> bool:
        return self.store.copy(source, destination) is not None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _safetensors_parameters(path: Path) -> int:
    """How many parameters the safetensors file holds (from its header alone)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    count = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for dim in tensor["shape"]:
            n *= dim
        count += n
    return count


def parameter_size(count: int) -> str:
    """Ollama's ``parameter_size``: ``135M``, ``1.7B``."""
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e3:.0f}K" if count else ""


_PARAMETERS = (  # generation_config.json -> Ollama's parameter names
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repeat_penalty"),
)


def loadable_from(stored: StoredModel, load: Loader, *, pinned: bool = False) -> Loadable:
    """The ``Loadable`` for a model in the store, built by ``load`` when it is loaded."""
    path: Path = stored.path
    manifest = stored.manifest
    config = _read_json(path / "config.json")
    tok = _read_json(path / "tokenizer_config.json")
    generation = _read_json(path / "generation_config.json")
    template = tok.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    template = template if isinstance(template, str) else ""
    capabilities: frozenset[Capability] = frozenset({"chat", "completion"} if template else {"completion"})
    weights = sorted(path.glob("*.safetensors"))
    size = sum(w.stat().st_size for w in weights)
    params = sum(_safetensors_parameters(w) for w in weights)
    arch = str(manifest.get("architecture") or config.get("model_type") or "")
    context = int(manifest.get("context_length") or config.get("max_position_embeddings") or 2048)
    lines = []
    if generation.get("do_sample") is False:
        lines.append("temperature 0")
    for source, name in _PARAMETERS:
        if isinstance(generation.get(source), (int, float)) and not (name == "temperature" and lines):
            lines.append(f"{name} {generation[source]}")
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params}
    for key, name in (
        ("max_position_embeddings", "context_length"),
        ("hidden_size", "embedding_length"),
        ("num_hidden_layers", "block_count"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("vocab_size", "vocab_size"),
        ("rope_theta", "rope.freq_base"),
    ):
        if key in config:
            info[f"{arch}.{name}"] = config[key]
    manifest_file = path / "manifest.json"
    card = ModelCard(
        format=str(manifest.get("format") or "mlx"),
        family=arch,
        parameter_size=parameter_size(params),
        quantization_level=str(manifest.get("dtype") or "").upper().replace("FLOAT", "F"),
        template=template,
        parameters="\n".join(lines),
        model_info=info,
        digest=str(manifest.get("source_sha256") or ""),
        modified_at=manifest_file.stat().st_mtime if manifest_file.exists() else 0.0,
    )
    return Loadable(
        id=stored.name,
        make=partial(load, path, stored.name),
        capabilities=capabilities,
        context_window=context,
        size=size,
        card=card,
        pinned=pinned,
    )
