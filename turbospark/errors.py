"""The exceptions turbospark raises, and the HTTP status each one hints at.

    TurboSparkError                  base of everything below; ``status`` is the HTTP hint
    ├── RequestInvalid (400)         the caller sent something we will not run
    │   └── ContextOverflow (400)    prompt + budget exceed the model's context window
    ├── Unauthorized (401)           missing or wrong API key
    ├── Forbidden (403)              an Origin or Host this server does not answer
    ├── ModelNotFound (404)          several models attached, none answers to the name
    ├── NotFound (404)               something else the request names is unknown
    ├── McpUnavailable (424)         an MCP server a request uses cannot list its tools now
    ├── Rejected (503, retryable)    capacity refusals, answered before any expensive work
    │   ├── QueueFull                the model's generation queue is at --max-queue
    │   └── ResolutionBusy           every model-resolution slot is taken
    ├── ResolutionFailed (500)       resolving the model raised something unexpected
    ├── ModelLoadFailed (503)        the model exists but could not be loaded
    ├── NoModel (503)                nothing capable of the request is attached
    ├── ShuttingDown (503)           the server stopped before the generation could finish
    └── GenerationFailed (500)       the backend failed while generating

These are plain exceptions, never exception groups: Quart-Trio dispatches error handlers on the
members of a group, so validation errors (which cattrs raises as groups) are turned into one
``RequestInvalid`` at the codec boundary.  Each route family renders them in its own shape.
"""

from __future__ import annotations

import random
import secrets
from typing import Any

__all__ = [
    "ContextOverflow",
    "Draining",
    "Forbidden",
    "GenerationFailed",
    "ModelInUse",
    "ModelLoadFailed",
    "McpUnavailable",
    "ModelNotFound",
    "NoModel",
    "NotFound",
    "QueueFull",
    "RankLost",
    "Rejected",
    "RequestInvalid",
    "ResolutionBusy",
    "ResolutionFailed",
    "ShuttingDown",
    "Forbidden",
    "TurboSparkError",
    "Unauthorized",
]


class TurboSparkError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    retryable: bool | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def extra(self) -> dict[str, object]:
        """Fields beyond message/type/param/code that this error adds to the OpenAI shape."""
        return {}


class RequestInvalid(TurboSparkError):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflow(RequestInvalid):
    """The prompt (or the prompt and the budget asked for) does not fit the model's context
    window.  ``context_window`` and ``prompt_tokens`` are the numbers the message names, where it
    names them; ``exact`` is False where ``prompt_tokens`` is a lower bound (a prompt too long
    to be worth encoding in full)."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None, context_window: int | None = None,
                 prompt_tokens: int | None = None, exact: bool = True) -> None:
        super().__init__(message, param=param)
        self.context_window, self.prompt_tokens, self.exact = context_window, prompt_tokens, exact

    @classmethod
    def prompt_too_long(cls, context_window: int, prompt_tokens: int, *, exact: bool) -> ContextOverflow:
        """A prompt that alone does not fit: its size (exact, or ``at least``) and the window."""
        size = f"{prompt_tokens:,} tokens" if exact else f"at least {prompt_tokens:,} tokens"
        return cls(
            f"The prompt is {size}; this model's context window is {context_window} tokens. "
            "Shorten the prompt, or serve a model with a longer context.",
            param="messages", context_window=context_window, prompt_tokens=prompt_tokens, exact=exact,
        )

    def hinted(self, hint: str) -> ContextOverflow:
        """The same refusal with ``hint`` (a client's own advice) after its message."""
        return ContextOverflow(f"{self.message} {hint}", param=self.param, context_window=self.context_window,
                               prompt_tokens=self.prompt_tokens, exact=self.exact)


class Unauthorized(TurboSparkError):
    status = 401
    type = "authentication_error"

    def __init__(self) -> None:
        super().__init__("invalid or missing API key")


class Forbidden(TurboSparkError):
    """The request came from a web page or host name this server does not answer."""

    status = 403
    type = "permission_error"


class ModelNotFound(TurboSparkError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    param = "model"

    def __init__(self, requested: str, available: list[str]) -> None:
        if available:
            names = ", ".join(available)
            message = (
                f"The model '{requested}' does not exist. This server has "
                f"{len(available)} models attached: {names}"
            )
        else:
            message = f"The model '{requested}' does not exist"
        super().__init__(message)
        self.available = available

    def extra(self) -> dict[str, object]:
        return {"available": self.available}


class NotFound(TurboSparkError):
    """Something the request names (other than a model) does not exist, e.g. a stored response."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class McpUnavailable(TurboSparkError):
    """An MCP server a request uses is down (starting, or restarting after it died): OpenAI's
    424 for a tool list it could not retrieve."""

    status = 424
    type = "external_connector_error"
    param = "tools"
    retryable = True

    def __init__(self, server: str, reason: str | None) -> None:
        super().__init__(f"Error retrieving tool list from MCP server '{server}': {reason or 'it is starting'}; "
                         "it is started again with a backoff")


class ModelInUse(TurboSparkError):
    """A model that requests still use cannot be deleted until they end."""

    status = 409
    type = "invalid_request_error"
    code = "model_in_use"
    param = "model"

    def __init__(self, model: str, seconds: float) -> None:
        super().__init__(f"'{model}' is still answering requests after {seconds:g} s; it was not deleted "
                         "(it unloads once they end: delete it then)")


class Rejected(TurboSparkError):
    status = 503
    retryable = True
    retry_after: int = 1


class QueueFull(Rejected):
    code = "queue_full"

    def __init__(self, model: str, limit: int) -> None:
        super().__init__(
            f"The generation queue for '{model}' is full ({limit} waiting). Retry the request shortly."
        )


class Draining(Rejected):
    """A request that arrived after shutdown began (on a kept-alive connection): another
    replica can answer it.  Answered with ``Connection: close``."""

    code = "draining"

    def __init__(self) -> None:
        super().__init__("The server is shutting down. Retry the request (another replica can answer it).")


class RankLost(Rejected):
    """A rank of the sharded model died or cannot be reached: this server can answer nothing
    more and exits; another replica can.  Answered with ``Connection: close``."""

    code = "rank_lost"

    def __init__(self, why: str) -> None:
        super().__init__(f"The server lost a rank of its sharded model ({why}) and is exiting. "
                         "Retry the request (another replica can answer it).")


class ResolutionBusy(Rejected):
    code = "model_resolution_busy"
    param = "model"

    def __init__(self) -> None:
        super().__init__("Model resolution is at capacity. Retry the request shortly.")


class ResolutionFailed(TurboSparkError):
    code = "model_resolution_failed"
    retryable = False

    def __init__(self) -> None:
        super().__init__("The model resolution task failed.")


class ModelLoadFailed(TurboSparkError):
    status = 503
    code = "model_load_failed"
    param = "model"
    retryable = False

    def __init__(self) -> None:
        super().__init__("The requested installed model could not be loaded.")


class NoModel(TurboSparkError):
    status = 503
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__(
            "no model capable of this request is loaded; attach one before sending requests"
        )


class ShuttingDown(TurboSparkError):
    status = 503
    retryable = True

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry against a running server")


class GenerationFailed(TurboSparkError):
    """An internal failure.  The client sees no internal detail, only an error id that the
    server's log line for it shows too."""

    status = 500
    type = "server_error"
    error_id: str | None = None

    @classmethod
    def new(cls, what: str = "generation failed") -> GenerationFailed:
        error_id = secrets.token_hex(6)
        error = cls(f"{what} (error id {error_id})")
        error.error_id = error_id
        return error


# --- fault injection (tests only) ------------------------------------------------------------
# Named points in the actors and threads call ``inject(point)``; it raises ``InjectedFault``
# when a test armed that point (``arm``, or ``TURBOSPARK_FAULTS="point[:times],..."`` in a
# server's environment), or at random with a rate (``arm_rate``, ``point:1%``: a soak's faults,
# seeded).  Nothing in the HTTP API reaches it; unarmed, it is two dict checks.

FAULT_POINTS = (
    "admission", "prefill chunk", "decode step", "delivery", "stop", "prefix-cache store",
    "encoder batch", "audio job", "image job", "resolver load", "observer write",
)
_armed: dict[str, int] = {}
_random = random.Random(0)  # the same faults for the same run


class InjectedFault(Exception):
    """Raised at an armed fault point (tests only)."""


#: points that fail at random, with their probability per pass (a soak's ``point:1%``)
_rates: dict[str, float] = {}


def arm(point: str, times: int = 1) -> None:
    """Make the next ``times`` passes through ``point`` raise (``times`` 0: disarm)."""
    _set(_armed, point, times)


def arm_rate(point: str, rate: float) -> None:
    """Make every pass through ``point`` raise with probability ``rate`` (0: disarm)."""
    _set(_rates, point, rate)


def _set(table: dict[str, Any], point: str, value: float) -> None:
    if point not in FAULT_POINTS:
        raise ValueError(f"no fault point {point!r}")
    if value:
        table[point] = value
    else:
        table.pop(point, None)


def inject(point: str) -> None:
    if not _armed and not _rates:
        return
    if (rate := _rates.get(point)) is not None and _random.random() < rate:
        raise InjectedFault(f"fault injected at {point}")
    left = _armed.get(point, 0)
    if left:
        if left == 1:
            del _armed[point]
        else:
            _armed[point] = left - 1
        raise InjectedFault(f"fault injected at {point}")


def _arm_from_environment() -> None:
    import os

    for item in filter(None, os.environ.get("TURBOSPARK_FAULTS", "").split(",")):
        point, _, times = item.partition(":")  # "point:N" (the next N passes) or "point:P%"
        if times.strip().endswith("%"):
            arm_rate(point.strip(), float(times.strip()[:-1]) / 100)
        else:
            arm(point.strip(), int(times or 1))


_arm_from_environment()
