"""MCP servers as actors: one per server of ``serve --mcp-config``, owning its child process or
connection (the official ``mcp`` SDK, on anyio, so on Trio).

    mcp_server          inbox: ListTools, CallTool
    ├── connection      connects (spawns the child, or opens the HTTP session), lists the tools,
    │                   lists them again every PING_S; when the server dies (that or a call finds the
    │                   connection closed) it connects again after a backoff (1 s doubling to 60 s)
    └── one task × tool call, bounded by the server's timeout

- **Ready means tried.**  ``task_status.started`` comes once the first connection has listed its
  tools, failed, or taken ``STARTUP_S``; a server that is down answers its calls with an error and
  its listing says why, while the connection keeps trying.
- **Cancellation reaches the tool.**  A ``CallTool`` carries a lifeline: a zero-buffer send channel
  whose receive end the asker holds and never reads.  The call's task blocks sending on it; when
  the asker leaves (the receive end closed), that send raises ``BrokenResourceError`` and the call's
  scope is cancelled, which makes the SDK send MCP's ``notifications/cancelled`` to the server.
- **Bounded.**  A call past the server's ``timeout`` is cancelled the same way and answered as an
  error; every call is counted (``McpCalled``: server, outcome, seconds).
- **No child outlives the server.**  The actor's scope ends at shutdown; the SDK's stdio transport
  closes the child's stdin, waits, then terminates its process tree.

A request's own servers (``serve --mcp-urls``: an HTTP URL on a public address) are the same actor,
started by ``mcp_remotes`` for as long as the request holds the ``OpenRemote``'s lifeline.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any

import attrs
import trio

from ..wire.mcp_config import McpServerSpec
from ._mailbox import answer, call

__all__ = [
    "CallTool", "ListTools", "McpCalled", "McpListing", "McpOutcome", "McpServers", "McpTool", "OpenRemote",
    "mcp_remotes", "mcp_server", "start_mcp_servers",
]

log = logging.getLogger("turbospark")

STARTUP_S = 20.0  # the first connection's bound before the server starts without it
REMOTE_STARTUP_S = 10.0  # the same for a request's own server (the request waits for it)
PING_S = 10.0  # how often a connected server is asked for its tools (and how soon a dead one is noticed)
BACKOFF_S = (1.0, 60.0)  # the first reconnection's wait, and the longest
MAX_OUTPUT_CHARS = 200_000  # of a tool's output the model reads (beyond it, cut and said so)


@attrs.frozen
class McpTool:
    server: str
    name: str
    description: str
    input_schema: Mapping[str, Any]
    annotations: Mapping[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """As OpenAI's ``mcp_list_tools`` item lists it."""
        return {"name": self.name, "description": self.description, "input_schema": dict(self.input_schema),
                "annotations": dict(self.annotations) if self.annotations else None}


@attrs.frozen
class McpListing:
    """One server as it stands: ``state`` is ``up``, ``starting`` or ``down`` (``error`` says why)."""

    server: str
    transport: str
    state: str
    tools: tuple[McpTool, ...] = ()
    error: str | None = None


@attrs.frozen
class McpOutcome:
    """A call's end: ``outcome`` is ``ok``, ``error`` (the tool said so), ``timeout``, ``cancelled``
    or ``failed`` (the server could not run it); ``text`` is the tool's output, ``error`` the
    message for any other outcome."""

    outcome: str
    text: str = ""
    error: str | None = None


@attrs.frozen
class McpCalled:
    """Observer event: one tool call ended."""

    server: str
    tool: str
    outcome: str
    seconds: float


@attrs.frozen
class ListTools:
    reply: trio.MemorySendChannel[McpListing]


@attrs.frozen
class CallTool:
    name: str
    arguments: Mapping[str, Any]
    reply: trio.MemorySendChannel[McpOutcome]
    lifeline: trio.MemorySendChannel[None]  # blocks until the asker leaves (see the module's note)


@attrs.frozen
class OpenRemote:
    """Start an actor for ``spec`` (a request's server); ``reply`` gets its inbox once it has
    tried to connect.  It lives until the asker closes ``lifeline``'s receive end."""

    spec: McpServerSpec
    reply: trio.MemorySendChannel[trio.MemorySendChannel[Any]]
    lifeline: trio.MemorySendChannel[None]


McpMessage = ListTools | CallTool
Connect = Callable[[McpServerSpec], Any]  # an async context manager of a connected client


def connect(spec: McpServerSpec) -> Any:
    """The SDK's client for ``spec`` (``_mcp_client``, imported once a server is configured)."""
    from ._mcp_client import connect as sdk_connect

    return sdk_connect(spec)


@attrs.define
class _Link:
    spec: McpServerSpec
    client: Any = None
    tools: tuple[McpTool, ...] = ()
    state: str = "starting"
    error: str | None = None
    lost: trio.Event = attrs.field(factory=trio.Event)

    def listing(self) -> McpListing:
        return McpListing(self.spec.name, self.spec.transport, self.state, self.tools, self.error)


async def mcp_server(spec: McpServerSpec, inbox: trio.MemoryReceiveChannel[McpMessage], emit: Callable[[object], None],
                     *, connector: Connect = connect, startup: float = STARTUP_S,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The actor of one MCP server (see the module's note)."""
    link = _Link(spec)
    async with trio.open_nursery() as nursery:
        await nursery.start(_connection, link, connector, startup)
        task_status.started()
        async with inbox:
            async for msg in inbox:
                if isinstance(msg, ListTools):
                    answer(msg.reply, link.listing())
                else:
                    nursery.start_soon(_call, link, msg, emit)
        nursery.cancel_scope.cancel()


async def _connection(link: _Link, connector: Connect, startup: float, *, task_status: trio.TaskStatus[None]) -> None:
    spec, wait, ready = link.spec, BACKOFF_S[0], False
    while True:
        link.lost = trio.Event()
        try:
            with trio.CancelScope(deadline=trio.current_time() + startup) as handshake:
                async with connector(spec) as client:
                    listed = await client.list_tools()
                    handshake.deadline = math.inf
                    link.client, link.state, link.error = client, "up", None
                    link.tools = tuple(_tool(spec.name, t) for t in listed.tools)
                    log.info("MCP server %r: %d tools (%s)", spec.name, len(link.tools),
                             ", ".join(t.name for t in link.tools) or "none")
                    wait = BACKOFF_S[0]
                    if not ready:
                        ready = True
                        task_status.started()
                    await _watch(client, link)
            if handshake.cancelled_caught:
                link.error = f"it did not answer within {startup:.0f} s"
        except Exception as exc:  # noqa: BLE001 - whatever ends the connection, it is tried again
            link.error = _reason(exc)
        link.client, link.state = None, "down"
        log.warning("MCP server %r is down (%s); trying again in %.0f s", spec.name, link.error, wait)
        if not ready:
            ready = True
            task_status.started()
        await trio.sleep(wait)
        wait = min(wait * 2, BACKOFF_S[1])


async def _watch(client: Any, link: _Link) -> None:
    """Return when the connection is lost: a listing unanswered (every PING_S, which also keeps
    the tools current), or a call that found it closed."""
    while True:
        with trio.move_on_after(PING_S):
            await link.lost.wait()
            link.error = link.error or "its connection closed"
            return
        with trio.move_on_after(PING_S) as asked:
            listed = await client.list_tools(cache_mode="bypass")
            link.tools = tuple(_tool(link.spec.name, t) for t in listed.tools)
        if asked.cancelled_caught:
            link.error = f"it did not answer within {PING_S:.0f} s"
            return


async def _call(link: _Link, msg: CallTool, emit: Callable[[object], None]) -> None:
    began, client, spec = trio.current_time(), link.client, link.spec
    outcome: McpOutcome | None = None
    if client is None:
        outcome = McpOutcome("failed", error=f"MCP server {spec.name!r} is not running ({link.error or 'starting'})")
    else:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_lifeline, msg.lifeline, nursery.cancel_scope)
            with trio.move_on_after(spec.timeout) as deadline:
                try:
                    outcome = _outcome(await client.call_tool(msg.name, dict(msg.arguments)))
                except Exception as exc:  # noqa: BLE001 - the call's failure is the call's alone
                    outcome = McpOutcome("failed", error=f"MCP server {spec.name!r}: {_reason(exc)}")
                    if "closed" in str(exc).lower():
                        link.lost.set()
            if deadline.cancelled_caught:
                outcome = McpOutcome("timeout", error=f"the tool {msg.name!r} took longer than {spec.timeout:g} s")
            nursery.cancel_scope.cancel()
    msg.lifeline.close()
    done = outcome or McpOutcome("cancelled", error="the client left")
    emit(McpCalled(spec.name, msg.name, done.outcome, trio.current_time() - began))
    answer(msg.reply, done)


async def _lifeline(lifeline: trio.MemorySendChannel[None], scope: trio.CancelScope) -> None:
    try:
        await lifeline.send(None)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()


def _tool(server: str, tool: Any) -> McpTool:
    annotations = tool.annotations.model_dump(exclude_none=True) if tool.annotations is not None else None
    schema = tool.input_schema if isinstance(tool.input_schema, Mapping) else {"type": "object"}
    return McpTool(server, tool.name, tool.description or "", dict(schema), annotations or None)


def _outcome(result: Any) -> McpOutcome:
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        else:
            parts.append(f"[{kind}: {getattr(block, 'mime_type', '') or 'content'}]")
    text = "\n".join(parts)
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"\n[the output was cut at {MAX_OUTPUT_CHARS:,} characters]"
    if result.is_error:
        return McpOutcome("error", text, text or "the tool failed")
    return McpOutcome("ok", text)


def _reason(exc: BaseException) -> str:
    """One line for what ended a connection or a call (the innermost of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]


@attrs.frozen
class McpServers:
    """The handles routes use: each configured server's inbox, by name; ``remotes``: the
    supervisor of requests' own servers (``serve --mcp-urls``), None when they are not allowed."""

    inboxes: Mapping[str, trio.MemorySendChannel[McpMessage]] = attrs.field(factory=dict)
    remotes: trio.MemorySendChannel[OpenRemote] | None = None

    async def opened(self, specs: Sequence[McpServerSpec], scope: Any) -> McpServers:
        """These handles and a request's own servers, started for as long as ``scope`` (the
        request's exit stack) is open."""
        if not specs:
            return self
        assert self.remotes is not None
        inboxes = dict(self.inboxes)
        for spec in specs:
            reply_send, reply_recv = trio.open_memory_channel[trio.MemorySendChannel[McpMessage]](1)
            life_send, life_recv = trio.open_memory_channel[None](0)
            scope.callback(life_recv.close)
            with reply_recv:
                await self.remotes.send(OpenRemote(spec, reply_send, life_send))
                inboxes[spec.name] = await reply_recv.receive()
        return attrs.evolve(self, inboxes=inboxes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.inboxes)

    async def listings(self, names: Sequence[str] | None = None) -> list[McpListing]:
        """Each server's tools and state (all, or ``names``, in that order), asked at once."""
        chosen = list(self.inboxes) if names is None else list(names)
        found: dict[str, McpListing] = {}

        async def ask(name: str) -> None:
            found[name] = await call(self.inboxes[name], ListTools)

        async with trio.open_nursery() as nursery:
            for name in chosen:
                nursery.start_soon(ask, name)
        return [found[name] for name in chosen]

    async def call(self, server: str, name: str, arguments: Mapping[str, Any]) -> McpOutcome:
        """Run one tool; leaving (cancellation) cancels it on the server."""
        async with aclosing(self.running(server, name, arguments)) as running:
            async for outcome in running:
                if outcome is not None:
                    return outcome
        raise AssertionError("a call ends with its outcome")

    async def running(self, server: str, name: str, arguments: Mapping[str, Any],
                      tick: float = math.inf) -> AsyncIterator[McpOutcome | None]:
        """``call``, with None after every ``tick`` seconds it runs (a stream's keep-alive), then
        its outcome.  Leaving (cancellation, or closing this iterator) cancels it on the server."""
        reply_send, reply_recv = trio.open_memory_channel[McpOutcome](1)
        life_send, life_recv = trio.open_memory_channel[None](0)
        with reply_recv, life_recv:
            await self.inboxes[server].send(CallTool(name, arguments, reply_send, life_send))
            while True:
                outcome: McpOutcome | None = None
                with trio.move_on_after(tick):
                    try:
                        outcome = await reply_recv.receive()
                    except trio.EndOfChannel:  # the actor stopped (shutdown)
                        outcome = McpOutcome("failed", error=f"MCP server {server!r} stopped")
                yield outcome  # never inside the deadline's scope
                if outcome is not None:
                    return


async def mcp_remotes(inbox: trio.MemoryReceiveChannel[OpenRemote], emit: Callable[[object], None],
                      *, connector: Connect = connect, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The supervisor of requests' own servers: one ``mcp_server`` each, while its asker holds on."""
    async with trio.open_nursery() as nursery:
        task_status.started()
        async with inbox:
            async for msg in inbox:
                nursery.start_soon(_remote, msg, emit, connector)
        nursery.cancel_scope.cancel()


async def _remote(msg: OpenRemote, emit: Callable[[object], None], connector: Connect) -> None:
    send, recv = trio.open_memory_channel[McpMessage](64)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_lifeline, msg.lifeline, nursery.cancel_scope)
        await nursery.start(partial(mcp_server, msg.spec, recv, emit, connector=connector, startup=REMOTE_STARTUP_S))
        answer(msg.reply, send)


async def start_mcp_servers(nursery: trio.Nursery, specs: Sequence[McpServerSpec],
                            emit: Callable[[object], None], connector: Connect = connect,
                            remotes: bool = False) -> McpServers:
    """Start one actor per server, all at once; back when each has tried its first connection.
    ``remotes``: also the supervisor of requests' own servers."""
    remote_send = None
    if remotes:
        remote_send, remote_recv = trio.open_memory_channel[OpenRemote](64)
        await nursery.start(partial(mcp_remotes, remote_recv, emit, connector=connector))
    inboxes = {}
    async with trio.open_nursery() as starting:
        for spec in specs:
            send, recv = trio.open_memory_channel[McpMessage](64)
            inboxes[spec.name] = send
            starting.start_soon(_start_one, nursery, partial(mcp_server, spec, recv, emit, connector=connector))
    return McpServers(inboxes, remote_send)


async def _start_one(nursery: trio.Nursery, actor: Any) -> None:
    await nursery.start(actor)
