"""The current HTTP request's scope: an ``ExitStack`` that lives exactly as long as the request
(body included, or until its client leaves).  ``routes/_app.py`` sets it for every request;
whatever a request holds (reply channels, model leases) is put there and let go when it ends."""

from __future__ import annotations

import contextvars
from contextlib import ExitStack

__all__ = ["current_scope", "request_scope"]

_scope: contextvars.ContextVar[ExitStack] = contextvars.ContextVar("turbospark_request_scope")


def request_scope() -> ExitStack:
    """The exit stack of the current HTTP request (closed when its connection scope ends)."""
    return _scope.get()


def current_scope() -> ExitStack | None:
    """The current request's exit stack, or None outside a request."""
    return _scope.get(None)
