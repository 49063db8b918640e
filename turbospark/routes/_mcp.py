"""MCP tools run by the server within one response, for every API family that offers them.

A route that offers MCP tools (``turns/mcp_uses``) runs its turns through an ``McpLoop``: the
model's calls to MCP tools are executed here, through the servers' actors, their results join the
conversation, and the model is asked again, until it answers (text, or calls that are the
client's own), a call waits for the user's approval, or ``max_calls`` calls have run (the last
turn is then offered no MCP tool).  The family's framer (its ``*_events`` module) frames each
turn's events as usual, and three things more: the tools listed (``listed``), a call's outcome
(``ran``), and the usage of every turn added up, fed once at the end.

``prepared`` is what a route asks first: the servers a request uses (its own started, where
``serve --mcp-urls`` allows), their tools (one down is a 424) and the offer.  ``start`` runs the
calls a request approves (an ``mcp_approval_response``) and opens the first turn, so a refusal is
still an HTTP error; ``frames`` is the body streamed, ``whole`` the same drained for a response
sent whole (an error raised: nothing was sent).  A later turn is the first one's plan with the
conversation so far, no call forced, and ``text_format`` (a Responses ``text.format``'s grammar).  A client that leaves cancels the call that runs
(``McpServers.call``), like the generation.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any, Protocol
from urllib.parse import urlsplit

import attrs
import trio

from .._scope import current_scope
from ..actors.mcp import McpListing, McpOutcome, McpServers
from ..errors import GenerationFailed, McpUnavailable, RequestInvalid, TurboSparkError
from ..messages import ChatPrompt, ToolCall
from ..turns.chat import TemplateMessage, tool_call
from ..turns.guardrails import Guardrails
from ..model.constraint import Grammar
from ..turns.mcp_uses import McpOffer, McpRoute, McpUse, offer, tool_message
from ..turns.turn_events import CallEnd, Error, Reasoning, Text, TurnEvent, Usage
from ..wire.mcp_config import McpServerSpec
from . import _images
from ._turn import Framer, Turn, TurnPlan, _frames, open_turn

__all__ = ["Approved", "MAX_CALLS", "McpFramer", "McpLoop", "prepared"]

log = logging.getLogger("turbospark")

#: MCP calls one response runs at most, where the request sets no bound (``max_tool_calls``).
MAX_CALLS = 8


class McpFramer(Framer, Protocol):
    def listed(self, use: McpUse, listing: McpListing) -> list[bytes]: ...

    def ran(self, call: ToolCall, route: McpRoute, outcome: McpOutcome, approval: str | None = None) -> list[bytes]: ...


@attrs.frozen
class Approved:
    """A call the user answered: ``approve`` runs it; ``approval`` is the request's id."""

    call: ToolCall
    route: McpRoute
    approval: str
    approve: bool


async def prepared(servers: McpServers, uses: Sequence[McpUse],
                   param: str) -> tuple[McpServers, dict[str, McpListing], McpOffer]:
    """The servers a request uses, their listings and what is offered to the model."""
    if not uses:
        return servers, {}, offer((), {})
    servers = await _servers_for(servers, uses, param)
    listings = await _listings_of(servers, uses)
    return servers, listings, offer(uses, {name: listing.tools for name, listing in listings.items()})


async def _servers_for(servers: McpServers, uses: Sequence[McpUse], param: str) -> McpServers:
    """The servers a request uses: the configured ones, and its own (``serve --mcp-urls``), each
    on a public address checked here, started for as long as the request lasts."""
    specs = []
    for use in uses:
        if use.url is not None:
            address = await _public_address(use.url, use.label, param)
            specs.append(McpServerSpec(use.server, url=use.url, headers=dict(use.headers), address=address))
    return await servers.opened(specs, current_scope())


async def _public_address(url: str, label: str, param: str) -> str:
    """The address ``url``'s host resolves to, every one of them public (as image URLs are)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    with trio.move_on_after(_images.FETCH_S):
        try:
            addresses = await _images._resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
        except OSError:
            raise RequestInvalid(f"the MCP server {label!r}: its host {host!r} was not found", param=param) from None
        if not addresses or not all(_images._public(a) for a in addresses):
            raise RequestInvalid(f"the MCP server {label!r}: its host {host!r} is a loopback, private or reserved "
                                 "address; this server reaches public addresses only", param=param)
        return addresses[0]
    raise RequestInvalid(f"the MCP server {label!r}: resolving {host!r} took over {_images.FETCH_S:g} s", param=param)


async def _listings_of(servers: McpServers, uses: Sequence[McpUse]) -> dict[str, McpListing]:
    """The used servers' tools; one that is down is a 424 (``McpUnavailable``), as OpenAI's."""
    listings = await servers.listings(sorted({u.server for u in uses}))
    for listing in listings:
        if listing.state != "up":
            raise McpUnavailable(listing.server, listing.error)
    return {listing.server: listing for listing in listings}


@attrs.define
class McpLoop:
    plan: TurnPlan
    offer: McpOffer
    servers: McpServers
    request_id: int
    guardrails: Guardrails
    listed: Sequence[tuple[McpUse, McpListing]] = ()  # the listings the response shows
    approved: Sequence[Approved] = ()
    max_calls: int = MAX_CALLS
    text_format: Grammar | None = None  # the grammar later turns keep (a Responses text.format)
    turn: Turn | None = None
    outcomes: list[McpOutcome] = attrs.field(factory=list)

    async def start(self) -> None:
        """Run the approved calls, then open the first turn (its refusal raised here)."""
        results = []
        for one in self.approved:
            outcome = McpOutcome("declined")
            if one.approve:
                async with aclosing(self._run(one.call, one.route)) as running:
                    async for outcome in running:  # noqa: B007 - the last is the outcome (no ticks: no deadline)
                        pass
            self.outcomes.append(outcome)
            if one.approve:
                results.append(tool_message(one.call.id, outcome.text, outcome.error))
        if results:
            assert isinstance(self.plan.prompt, ChatPrompt)
            self.plan = attrs.evolve(self.plan, prompt=attrs.evolve(
                self.plan.prompt, messages=(*self.plan.prompt.messages, *results)))
        self.turn = await open_turn(self.plan, request_id=self.request_id, guardrails=self.guardrails)

    def frames(self, framer: McpFramer, *, keepalive: float,
               error: Callable[[TurboSparkError], list[bytes]]) -> AsyncIterator[bytes]:
        """The response's body: every turn's frames and every call's, then the usage once."""

        async def guarded() -> AsyncIterator[bytes]:
            try:
                async with aclosing(body()) as frames:
                    async for frame in frames:
                        yield frame
            except TurboSparkError as exc:
                yield b"".join(error(exc))
            except Exception:  # a bug: logged with an id the client sees
                failure = GenerationFailed.new()
                log.exception("an MCP response failed (error id %s)", failure.error_id)
                yield b"".join(error(failure))

        async def body() -> AsyncIterator[bytes]:
            assert self.turn is not None
            first = [*framer.opening()]
            for use, listing in self.listed:
                first += framer.listed(use, listing)
            for one, outcome in zip(self.approved, self.outcomes):
                if one.approve:
                    first += framer.ran(one.call, one.route, outcome, one.approval)
            yield b"".join(first)
            turn, made, usage = self.turn, 0, None
            messages = turn.plan.prompt.messages if isinstance(turn.plan.prompt, ChatPrompt) else ()
            while True:
                said: list[TurnEvent] = []
                async with aclosing(turn.batches(keepalive)) as batches:
                    async for batch in batches:
                        out: list[bytes] = []
                        for event in batch:
                            if isinstance(event, Error):
                                yield b"".join([*out, *error(event.error)])
                                return
                            if isinstance(event, Usage):
                                usage = _added(usage, event)
                                continue
                            if isinstance(event, CallEnd | Text | Reasoning):
                                said.append(event)
                            out += _frames(framer, event)
                        if out:
                            yield b"".join(out)
                calls = [e.call for e in said if isinstance(e, CallEnd)]
                runnable = [c for c in calls if c.name in self.offer.routes and not self.offer.routes[c.name].approval]
                results = []
                for call in runnable:
                    route = self.offer.routes[call.name]
                    async with aclosing(self._run(call, route, keepalive)) as running:
                        async for outcome in running:  # a keep-alive tick while the tool runs, then its outcome
                            yield b"".join(framer.tick() if outcome is None else framer.ran(call, route, outcome))
                    assert outcome is not None
                    results.append(tool_message(call.id, outcome.text, outcome.error))
                made += len(runnable)
                if not runnable or len(runnable) < len(calls):
                    break  # answered; or calls wait for the client or for approval
                messages = (*messages, _assistant(said), *results)
                tools = turn.plan.prompt.tools if isinstance(turn.plan.prompt, ChatPrompt) else ()
                if made >= self.max_calls:
                    tools = tuple(t for t in tools or () if t["function"]["name"] not in self.offer.routes)
                try:
                    turn = await open_turn(self._later(messages, tuple(tools or ())), request_id=self.request_id,
                                           guardrails=self.guardrails, context=turn.context)
                except TurboSparkError as exc:
                    yield b"".join(error(exc))
                    return
            assert usage is not None
            yield b"".join(framer.feed(usage))

        return guarded()

    async def whole(self, framer: McpFramer) -> None:
        """The body drained, for a response sent whole: its framer holds the result."""
        async with aclosing(self.frames(framer, keepalive=math.inf, error=_raise)) as frames:
            async for _ in frames:
                pass

    def _later(self, messages: tuple[TemplateMessage, ...], tools: tuple[dict[str, Any], ...]) -> TurnPlan:
        prompt = self.plan.prompt
        assert isinstance(prompt, ChatPrompt)
        return attrs.evolve(self.plan, prompt=attrs.evolve(prompt, messages=messages, tools=tools),
                            params=attrs.evolve(self.plan.params, grammar=self.text_format), call_required=False)

    async def _run(self, call: ToolCall, route: McpRoute, tick: float = math.inf) -> AsyncIterator[McpOutcome | None]:
        """``McpServers.call``: None every ``tick`` seconds the tool runs, then its outcome."""
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            yield McpOutcome("failed", error="the call's arguments are not a JSON object")
            return
        async with aclosing(self.servers.running(route.server, route.tool, arguments, tick)) as running:
            async for outcome in running:
                yield outcome


def _raise(exc: TurboSparkError) -> list[bytes]:
    raise exc


def _assistant(said: Sequence[TurnEvent]) -> TemplateMessage:
    """A turn's text, reasoning and calls as the assistant's message the next turn reads."""
    turn: TemplateMessage = {"role": "assistant", "content": "".join(e.text for e in said if isinstance(e, Text))}
    reasoning = "".join(e.text for e in said if isinstance(e, Reasoning))
    if reasoning:
        turn["reasoning_content"] = reasoning
    turn["tool_calls"] = [
        tool_call({"id": e.call.id, "function": {"name": e.call.name, "arguments": e.call.arguments}})
        for e in said if isinstance(e, CallEnd)
    ]
    return turn


def _added(a: Usage | None, b: Usage) -> Usage:
    if a is None:
        return b
    return Usage(*(x + y for x, y in zip(attrs.astuple(a), attrs.astuple(b))))
