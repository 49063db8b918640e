"""The request scope: an ``ExitStack`` that lives exactly as long as the current HTTP request
(body included, or until its client leaves).  ``web/app.py`` sets it for every request; whatever
a request holds (reply channels, the model leases ``System.resolve`` grants) is put there and let
go when it ends."""

from __future__ import annotations

import contextvars
from contextlib import ExitStack

__all__ = ["current_scope", "enter_request_scope", "request_scope"]

_request_scope: contextvars.ContextVar[ExitStack] = contextvars.ContextVar("turbospark_request_scope")


def request_scope() -> ExitStack:
    """The exit stack of the current HTTP request (closed when its connection scope ends)."""
    return _request_scope.get()


def current_scope() -> ExitStack | None:
    """The current request's exit stack, or None outside a request."""
    return _request_scope.get(None)


def enter_request_scope(stack: ExitStack) -> contextvars.Token[ExitStack]:
    """Make ``stack`` the current request's scope (``web/app.py``, once per request)."""
    return _request_scope.set(stack)
