"""The model store as the server sees it: what may be loaded (the resolver's library), and what
the management routes do to it (pull, copy, create, delete).

Every stored model of a kind the server can load is ``Loadable``: generation (chat and
completion), embedding, speech-to-text and text-to-speech models.  What is known before loading
it comes from its directory: capabilities (a chat template makes it a chat model), context
window, the memory it takes (its weights' size), and its card (``card.py``: architecture,
parameter count, quantization, what it can do, Ollama's ``model_info``).  How a model is loaded
is not the store's to know: whoever builds the shelf (``cli/attach.py``) hands it a loader per
kind, a callable that builds the backend (encoder, engine) from a model directory and the model's
id; a kind without one is not offered.  Everything here is blocking file work: the resolver and
the routes call it on a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from ..actors.lifecycle import KINDS, Loadable
from ..actors.registry import Capability
from .card import card_for, parameter_size, weights_of
from .catalogue import CATALOGUE
from .blobs import BlobStore, lay_out
from .derive import create_derived, spec_of
from .directory import StoredModel, check_name
from .ollama_import import PREFIX as OLLAMA_PREFIX
from .ollama_import import available as ollama_available
from ..wire.modelfile import ModelSpec, render
from .progress import Progress, Report
from .pull import pull
from .store import ModelStore

__all__ = ["Loader", "StoreShelf", "loadable_from", "parameter_size"]

#: ``load(path, model_id)``: the backend for the model in directory ``path``, built on its model
#: thread (``cli/attach.py``'s ``load_mlx``).
Loader = Callable[[Path, str], Any]
_CAPABILITY: dict[str, Capability] = {
    "embedding": "embedding", "speech-to-text": "speech_to_text", "text-to-speech": "text_to_speech",
    "text-to-image": "text_to_image",
}


class StoreShelf:
    """The store as the resolver's library (``loadables``) and the management routes' target.
    ``load`` builds a generation model; ``loaders``, the other kinds', by kind."""

    def __init__(self, store: ModelStore, load: Loader, loaders: Mapping[str, Loader] | None = None) -> None:
        self.store = store
        self.load = load
        self.loaders: dict[str, Loader] = {"generation": load, **(loaders or {})}

    def loadables(self) -> list[Loadable]:
        out = []
        for stored in self.store.list():
            load = self.loaders.get(stored.kind)
            if load is None:
                continue
            try:
                out.append(loadable_from(stored, load))
            except (OSError, ValueError, KeyError, TypeError):
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

    def create(self, name: str, spec: ModelSpec, adapters: dict[str, str] | None = None) -> str:
        """Make the derived model ``name`` (``derive.py``), carrying the adapter uploaded as
        ``adapters`` (file name -> blob digest: a GGUF LoRA, or an mlx-lm adapter directory's
        files) where given; the digest of its base's weights."""
        if not adapters:
            return str(create_derived(self.store, name, spec).manifest.get("source_sha256", ""))
        with self.store.scratch() as work:
            source = lay_out(self.blobs, adapters, work)  # a GGUF blob itself, or a folder of the files
            stored = create_derived(self.store, name, attrs.evolve(spec, adapter=str(source)))
        for blob in set(adapters.values()):
            self.blobs.remove(blob)
        return str(stored.manifest.get("source_sha256", ""))

    @property
    def blobs(self) -> BlobStore:
        return BlobStore(self.store.root)

    def import_files(self, name: str, files: dict[str, str], spec: ModelSpec | None, report: Report) -> str:
        """Make model ``name`` from uploaded blobs (``files``: file name -> digest), given
        ``spec``'s settings when it has any; the digest of its weights.  The blobs are removed
        once the model is in the store.  An import that fails (``ModelImportError`` saying why)
        leaves the store unchanged; settings the new model cannot take remove it again (an
        earlier model of that name was replaced, as any import replaces it)."""
        check_name(name)
        with self.store.scratch() as work:
            source = lay_out(self.blobs, files, work)
            label = "uploaded " + ", ".join(f"{n} ({d})" for n, d in sorted(files.items()))
            stored = self.store.import_source(source, name=name, progress=Progress(report=report), label=label)
        digest = self._settle(stored, spec, report)
        for blob in set(files.values()):  # converted into the store: the upload is a second copy
            self.blobs.remove(blob)
        return digest

    def import_ollama(self, name: str, source: str, spec: ModelSpec | None, report: Report) -> str:
        """Import ``ollama:NAME[:TAG]`` from Ollama's store as ``name``, given ``spec``'s
        settings when it has any; its digest."""
        check_name(name)
        stored = self.store.import_source(source, name=name, progress=Progress(report=report))
        return self._settle(stored, spec, report)

    def _settle(self, stored: StoredModel, spec: ModelSpec | None, report: Report) -> str:
        """``stored`` given ``spec``'s settings; a model that cannot take them is removed again."""
        if spec is not None:
            report("applying the settings", None, None)
            try:
                stored = create_derived(self.store, stored.name, attrs.evolve(spec, base=stored.name), in_place=True)
            except BaseException:
                self.store.remove(stored.name)
                raise
        return str(stored.manifest.get("source_sha256", ""))

    def ollama_models(self) -> list[dict[str, Any]]:
        """The models in Ollama's store on this machine, as the page offers them for import."""
        return [
            {"name": f"{OLLAMA_PREFIX}{listed.name}", "store_name": listed.name.store_name, "size": listed.size,
             "family": listed.family, "quantization": listed.quantization, "problem": listed.problem}
            for listed in ollama_available()
        ]

    def modelfile(self, name: str) -> tuple[str, str] | None:
        """The Modelfile that makes ``name`` (a derived model's settings, an imported Ollama
        model's system prompt and parameters) and its licence text; None for an unknown name."""
        stored = self.store.get(name)
        if stored is None:
            return None
        spec = spec_of(stored)
        if spec is None:
            record = stored.manifest.get("ollama") if isinstance(stored.manifest.get("ollama"), dict) else {}
            spec = ModelSpec(base=name, system=record.get("system"), parameters=dict(record.get("params") or {}))
        licence = "\n".join(spec.licenses) or "\n\n".join(
            f.read_text(encoding="utf-8", errors="replace") for f in sorted(stored.path.glob("LICENSE*")) if f.is_file()
        )
        return render(spec, name=name), licence


def loadable_from(stored: StoredModel, load: Loader, *, pinned: bool = False) -> Loadable:
    """The ``Loadable`` for a model in the store, built by ``load`` when it is loaded."""
    path: Path = stored.path
    card = card_for(stored)
    kind = stored.kind if stored.kind in KINDS else "generation"
    if kind == "generation":
        capabilities: frozenset[Capability] = frozenset({"chat", "completion"} if card.template else {"completion"})
        if "vision" in card.capabilities:  # it reads images (a vision tower beside it)
            capabilities |= {"vision"}
        size = sum(w.stat().st_size for w in weights_of(path))
    else:
        capabilities = frozenset({_CAPABILITY[kind]})
        size = stored.disk_size()  # an encoder's or voice's files are what it loads
    return Loadable(
        id=stored.name,
        make=partial(load, path, stored.name),
        capabilities=capabilities,
        context_window=card.context_length or (2048 if kind == "generation" else 0),
        size=size,
        card=card,
        pinned=pinned,
        kind=kind,
    )
