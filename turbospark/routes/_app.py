"""The Quart-Trio application: request scope, auth, observation and error shapes.

Every HTTP request runs inside one ``ExitStack`` that lives exactly as long as Quart-Trio's
per-connection nursery: until the response body is fully sent, or until the client disconnects
and the nursery is cancelled.  Routes put their reply channels there, so a reply channel is
closed (and the model thread told to stop) however the request ends, even if the client leaves
between the route returning and the body starting.
"""

from __future__ import annotations

import hmac
import json
import itertools
import logging
import time
from contextlib import ExitStack
from typing import Any, Literal

import attrs
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import Response, g, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .._system import System
from ..errors import TurboSparkError, Unauthorized
from ..messages import RequestFinished, RequestStarted
from ..scope import _scope, request_scope

__all__ = [
    "Family",
    "create_app",
    "error_body",
    "exception_body",
    "json_response",
    "request_scope",
    "system",
]

log = logging.getLogger("turbospark")

Family = Literal["openai", "anthropic", "ollama"]

class InFlight:
    """How many HTTP requests are being answered (body included), for a shutdown that waits
    for them, and only them: an idle keep-alive connection holds nothing."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle = trio.Event() if self.count == 1 else self._idle

    def exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.count:
            await self._idle.wait()


class _ScopedConnection(TrioASGIHTTPConnection):
    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        in_flight: InFlight = self.app.in_flight  # type: ignore[attr-defined]
        in_flight.enter()
        with ExitStack() as stack:
            token = _scope.set(stack)
            try:
                await super().__call__(receive, send)
            finally:
                _scope.reset(token)
                in_flight.exit()


class _App(QuartTrio):
    asgi_http_class = _ScopedConnection
    in_flight: InFlight


def system() -> System:
    return g.system  # type: ignore[no-any-return]


@attrs.define
class _Record:
    """What the observer is told when a request ends (outlives the request context)."""

    id: int
    route: str
    began: float
    error: str | None = None
    finished: bool = False


def family_of(path: str) -> Family:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(
    family: Family,
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    retryable: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An error in the shape the API family uses (also inside streams' error frames)."""
    if family == "ollama":
        return {"error": message}
    if family == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    error: dict[str, Any] = {"message": message, "type": type, "param": param, "code": code}
    if retryable is not None:
        error["retryable"] = retryable
    error.update(extra or {})
    return {"error": error}


def exception_body(exc: TurboSparkError, family: Family) -> dict[str, Any]:
    return error_body(
        family,
        exc.status,
        exc.message,
        type=exc.type,
        code=exc.code,
        param=exc.param,
        retryable=exc.retryable,
        extra=exc.extra(),
    )


def error_response(status: int, body: dict[str, Any], message: str) -> Response:
    record = g.get("record")
    if record is not None:
        record.error = message
    return json_response(body, status)


def json_response(body: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False), status=status, content_type="application/json"
    )


def _turbospark_error(exc: TurboSparkError) -> Response:
    response = error_response(exc.status, exception_body(exc, family_of(request.path)), exc.message)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def _http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    messages = {
        404: f"no route {request.method} {request.path}",
        405: f"method {request.method} is not allowed on {request.path}",
        413: "the request body is larger than the 25 MiB limit",
    }
    message = messages.get(status) or exc.description or exc.name
    response = error_response(status, error_body(family_of(request.path), status, message), message)
    if status == 413:
        response.headers["Connection"] = "close"  # the unread body must not be parsed as a request
    return response


def _unexpected(exc: Exception) -> Response:
    log.exception("unhandled error while serving %s %s", request.method, request.path)
    message = f"internal error: {type(exc).__name__}"
    return error_response(
        500, error_body(family_of(request.path), 500, message, type="server_error"), message
    )


def _authorized(key: str) -> bool:
    given = request.headers.get("x-api-key") or ""
    if not given:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
    return bool(given) and hmac.compare_digest(given.encode(), key.encode())


def create_app(sys_: System) -> QuartTrio:
    app = _App("turbospark")
    app.in_flight = InFlight()
    app.config["MAX_CONTENT_LENGTH"] = sys_.settings.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    ids = itertools.count()

    @app.before_request
    async def _begin() -> None:
        g.system = sys_
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        g.record = record = _Record(next(ids), route, time.monotonic())
        sys_.emit(RequestStarted(record.id, int(time.time() * 1000), request.method, request.path))
        # A request that never gets a response (its client left) is still recorded, as 499.
        request_scope().callback(_finish, record, 499)
        if sys_.settings.api_key and request.path != "/health":
            if not _authorized(sys_.settings.api_key):
                raise Unauthorized()

    def _finish(record: _Record, status: int) -> None:
        if record.finished:
            return
        record.finished = True
        sys_.emit(
            RequestFinished(
                id=record.id,
                route=record.route,
                status=status,
                duration_ms=round((time.monotonic() - record.began) * 1000, 3),
                error=record.error if status >= 400 else None,
            )
        )

    @app.after_request
    async def _end(response: Response) -> Response:
        record = g.get("record")
        if record is not None:
            _finish(record, response.status_code)
        return response

    app.register_error_handler(TurboSparkError, _turbospark_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)

    from . import (
        health, metrics, models, ollama, ollama_embed, openai_chat, openai_completions,
        openai_embeddings, openai_responses,
    )

    for module in (
        health, models, metrics, openai_chat, openai_completions, openai_responses,
        openai_embeddings, ollama_embed, ollama,
    ):
        app.register_blueprint(module.blueprint)
    return app
