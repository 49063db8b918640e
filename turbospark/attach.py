"""Which backends ``serve`` attaches: the scripted backend, and MLX models from the store."""

from __future__ import annotations

from functools import partial

from .config import Settings
from .model.backend import BackendSpec
from .model.scripted import SCRIPTED_ID, ScriptedBackend

__all__ = ["ModelSetupError", "backend_specs"]


class ModelSetupError(Exception):
    """A model named on the command line cannot be attached (message says why)."""


def backend_specs(settings: Settings) -> list[BackendSpec]:
    """What to attach for ``--model`` (each one's backend is built on its own model thread)."""
    specs = []
    for name in settings.models:
        if name == SCRIPTED_ID:
            make = partial(ScriptedBackend, script=settings.script, token_delay=settings.token_delay)
            specs.append(BackendSpec(SCRIPTED_ID, make))
        else:
            raise ModelSetupError(f"unknown model '{name}'")
    if not specs:
        raise ModelSetupError("no model given: use --model scripted or --model ID")
    return specs
