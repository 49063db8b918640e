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
import secrets
import time
from contextlib import ExitStack
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import Blueprint, Response, g, has_request_context, request, websocket
from quart_trio import QuartTrio
from quart_trio.wrappers.request import TrioRequest
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .._system import System, enter_request_scope, request_scope
from ..errors import Draining, Forbidden, RankLost, TurboSparkError, Unauthorized
from .origins import host_allowed, origin_allowed
from .page import is_page, subprotocol_key
from ..messages import RequestFinished, RequestStarted

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
        self.draining = trio.Event()  # set when shutdown begins: endless feeds end themselves

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
            token = enter_request_scope(stack)
            try:
                await super().__call__(receive, _shielded(send))
            finally:
                token.var.reset(token)
                in_flight.exit()


def _shielded(send: ASGISendCallable) -> ASGISendCallable:
    """The app's ``send``, shielded.  When a response ends a connection whose request body is
    still arriving (a 408 or 413), Hypercorn closes the socket from inside that ``send``, after
    telling the app of the disconnect, on which Quart-Trio cancels the request's nursery: the
    close would be cancelled half-way and the socket kept open for as long as the client
    trickles.  (Hypercorn shields the socket write itself already.)"""

    async def send_shielded(message: Any) -> None:
        with trio.CancelScope(shield=True):
            await send(message)

    return send_shielded


#: Audio uploads may be larger than every other body.
AUDIO_BODY_LIMIT = 128 * 1024 * 1024


class _Request(TrioRequest):
    """The body limit is chosen when the request is made: 128 MiB under /v1/audio/, none for a
    blob (a model's weights, streamed to disk as they arrive, never held whole)."""

    def __init__(self, method: str, scheme: str, path: str, *args: Any, max_content_length: int | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        if path.startswith("/v1/audio/"):
            max_content_length = AUDIO_BODY_LIMIT
        elif path.startswith("/api/blobs/"):
            max_content_length = None
        super().__init__(method, scheme, path, *args, max_content_length=max_content_length, **kwargs)
        self.body_limit = max_content_length  # what ``web/bodies.py`` counts a chunked body against


class _App(QuartTrio):
    asgi_http_class = _ScopedConnection
    request_class = _Request
    in_flight: InFlight
    #: set when shutdown begins: requests (but the health probes) are answered ``Draining``
    draining: bool = False
    realtime_sessions: int  # open realtime transcription WebSockets


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


def _path() -> str:
    """The path of the request (or WebSocket upgrade) being answered."""
    return request.path if has_request_context() else websocket.path


def _turbospark_error(exc: TurboSparkError) -> Response:
    response = error_response(exc.status, exception_body(exc, family_of(_path())), exc.message)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    if isinstance(exc, Draining | RankLost):
        response.headers["Connection"] = "close"  # the next request goes to a new connection
    return response


def _probe(path: str) -> bool:
    """The health probes: never authenticated, answered while draining."""
    return path == "/health" or path.startswith("/health/")


def _http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    http = has_request_context()  # else a WebSocket upgrade (its own context, no method or body)
    path = _path()
    method = request.method if http else "WebSocket"
    limit = (g.system.settings.max_body_bytes >> 20) if "system" in g else 25
    messages = {
        404: f"no route {method} {path}",
        405: f"method {method} is not allowed on {path}",
        413: f"the request body is larger than the {limit} MiB limit",
        408: f"the request body did not arrive within {request.body_timeout:g} seconds" if http
        else "the request did not arrive in time",
    }
    if status == 413 and path.startswith("/v1/audio/"):
        messages[413] = "request body too large; audio uploads are limited to 128 MiB"
    message = messages.get(status) or exc.description or exc.name
    response = error_response(status, error_body(family_of(path), status, message), message)
    if status in (408, 413):
        response.headers["Connection"] = "close"  # the unread body must not be parsed as a request
    return response


def _unexpected(exc: Exception) -> Response:
    error_id = secrets.token_hex(6)
    log.error("unhandled error while serving %s (error id %s)", _path(), error_id,
              exc_info=exc)  # the handler runs after the except block: pass it on
    message = f"internal error (error id {error_id})"
    return error_response(
        500, error_body(family_of(_path()), 500, message, type="server_error"), message
    )


def _preflight(origin: str) -> Response:
    """A CORS preflight from an allowed origin (refused ones never get here)."""
    response = Response("", status=204)
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, HEAD, OPTIONS"
    response.headers["Access-Control-Allow-Headers"] = (
        request.headers.get("access-control-request-headers")
        or "authorization, content-type, x-api-key, anthropic-version, anthropic-beta"
    )
    response.headers["Access-Control-Max-Age"] = "600"
    response.headers["Vary"] = "Origin"
    return response


def _authorized(key: str, headers: Any = None) -> bool:
    headers = request.headers if headers is None else headers
    given = headers.get("x-api-key") or subprotocol_key(headers.get("sec-websocket-protocol"))
    if not given:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
    return bool(given) and hmac.compare_digest(given.encode(), key.encode())


def _check_origin_and_host(headers: Any, settings: Any) -> None:
    """Other websites (``Origin``) and rebound DNS names (``Host``) are refused; see origins.py."""
    if not host_allowed(headers.get("host"), settings.host):
        raise Forbidden(
            f"the Host {headers.get('host')!r} is not a loopback name; a server bound to "
            "loopback answers loopback names only"
        )
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(origin, settings.allowed_origins):
        raise Forbidden(f"requests from the origin {origin!r} are not allowed (--allowed-origins)")


def create_app(sys_: System, blueprints: Sequence[Blueprint]) -> QuartTrio:
    """The Quart-Trio app: request scope, origin, host and key checks, error shapes, the
    request record; the routes come in as ``blueprints`` (``routes/app.py`` chooses them)."""
    app = _App("turbospark")
    app.in_flight = InFlight()
    app.config["MAX_CONTENT_LENGTH"] = sys_.settings.max_body_bytes
    app.config["BODY_TIMEOUT"] = sys_.settings.body_timeout  # a body must arrive in this time
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    ids = itertools.count()

    @app.before_request
    async def _begin() -> Response | None:
        g.system = sys_
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        g.record = record = _Record(next(ids), route, time.monotonic())
        sys_.emit(RequestStarted(record.id, int(time.time() * 1000), request.method, request.path))
        # A request that never gets a response (its client left) is still recorded, as 499.
        request_scope().callback(_finish, record, 499)
        settings = sys_.settings
        _check_origin_and_host(request.headers, settings)
        origin = request.headers.get("origin")
        if request.method == "OPTIONS" and origin is not None:
            return _preflight(origin)
        if app.draining and not _probe(request.path):
            raise Draining()
        if sys_.failure and not _probe(request.path):
            raise sys_.failure[0]
        public = _probe(request.path) or is_page(request.method, request.path, request.headers.get("accept"))
        if settings.api_key and not public and not _authorized(settings.api_key):
            raise Unauthorized()
        return None

    @app.before_websocket
    async def _begin_websocket() -> None:
        g.system = sys_
        settings = sys_.settings
        headers = websocket.headers
        _check_origin_and_host(headers, settings)  # as for every route: before the key
        if app.draining:
            raise Draining()
        if settings.api_key and not _authorized(settings.api_key, headers):
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
    async def _cors(response: Response) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and origin_allowed(origin, sys_.settings.allowed_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "x-anyllm-degradation, retry-after, x-turbospark-retries"
            response.headers["Vary"] = "Origin"
        return response

    @app.after_request
    async def _end(response: Response) -> Response:
        record = g.get("record")
        if record is not None:
            _finish(record, response.status_code)
        return response

    app.register_error_handler(TurboSparkError, _turbospark_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)

    app.realtime_sessions = 0  # open realtime transcription sockets (routes/audio_realtime.py)
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    return app
