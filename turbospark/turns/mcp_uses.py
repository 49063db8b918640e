"""Which MCP tools a request lets the model use, and which of its calls wait for approval (sans-io).

A request names configured servers: OpenAI Responses' ``{"type": "mcp", "server_label",
"allowed_tools", "require_approval"}`` tools (``responses_uses``) and Anthropic's ``mcp_servers``
with their ``mcp_toolset`` tools (``anthropic_uses``).  A server is one of ``serve
--mcp-config``'s, by name (a request never starts a process), or, only where ``serve --mcp-urls``
allows it, an HTTP URL the request gives (OpenAI's ``server_url``, Anthropic's ``url``), at most
``MAX_REMOTE`` of them; the route checks its address (``routes/_mcp``).
``offer`` joins the uses with the servers' listings: the function tools shown to the model (each
server's tools under their own names, a name two servers share prefixed with its label) and, by
the name the model calls, where each call goes (``McpRoute``).  Plain functions: no Trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs

from ..errors import RequestInvalid

__all__ = ["DECLINED", "MAX_REMOTE", "McpOffer", "McpRoute", "McpUse", "anthropic_uses", "offer", "responses_uses", "tool_message"]

#: What the model is told of a call the user declined.
DECLINED = "The user declined to run this tool call."
#: A request's own servers (serve --mcp-urls), at most.
MAX_REMOTE = 4


@attrs.frozen
class McpUse:
    """One server a request uses: ``label`` is what the request calls it (OpenAI's
    ``server_label``, Anthropic's ``name``); ``allowed`` None allows every tool but ``denied``;
    ``approval`` (``always`` or ``never``) holds for every tool but those in ``flipped``."""

    label: str
    server: str
    allowed: frozenset[str] | None = None
    denied: frozenset[str] = frozenset()
    approval: str = "never"
    flipped: frozenset[str] = frozenset()
    url: str | None = None  # a request's own server (serve --mcp-urls)
    headers: tuple[tuple[str, str], ...] = ()

    def offers(self, tool: str) -> bool:
        return tool not in self.denied and (self.allowed is None or tool in self.allowed)

    def asks(self, tool: str) -> bool:
        return (self.approval == "always") != (tool in self.flipped)


@attrs.frozen
class McpRoute:
    """Where one model-side tool name goes."""

    label: str
    server: str
    tool: str
    approval: bool


@attrs.frozen
class McpOffer:
    uses: tuple[McpUse, ...]
    tools: tuple[dict[str, Any], ...]  # function tools, in the chat shape the core takes
    routes: Mapping[str, McpRoute]

    def __bool__(self) -> bool:
        return bool(self.uses)


def responses_uses(tools: Sequence[Mapping[str, Any]] | None, configured: Sequence[str],
                   remote: bool = False) -> tuple[McpUse, ...]:
    """The ``mcp`` tools of a Responses request; ``remote``: ``server_url`` is allowed."""
    out: list[McpUse] = []
    for i, tool in enumerate(tools or ()):
        if tool.get("type") != "mcp":
            continue
        where = f"tools[{i}]"
        label = tool.get("server_label")
        if not isinstance(label, str) or not label:
            raise RequestInvalid(f"{where}.server_label must be a non-empty string", param="tools")
        if tool.get("connector_id") is not None:
            raise RequestInvalid(f"{where}: connectors are OpenAI's own; name an MCP server ({_known(configured)})",
                                 param="tools")
        url, headers = tool.get("server_url"), dict(tool.get("headers") or {})
        if isinstance(tool.get("authorization"), str):
            headers["Authorization"] = f"Bearer {tool['authorization']}"
        _check_server(label, url, headers, configured, remote, where, "tools")
        if any(u.label == label for u in out):
            raise RequestInvalid(f"{where}: the MCP server {label!r} is named twice", param="tools")
        approval, flipped = _approval(tool, where)
        out.append(McpUse(label, label, _allowed(tool.get("allowed_tools"), where), approval=approval,
                          flipped=flipped, url=url, headers=tuple(headers.items())))
    return _bounded(out, "tools")


def anthropic_uses(servers: Sequence[Mapping[str, Any]] | None, tools: Sequence[Mapping[str, Any]] | None,
                   configured: Sequence[str], remote: bool = False) -> tuple[McpUse, ...]:
    """Anthropic's MCP connector: ``mcp_servers`` entries (``{"type": "url", "url", "name",
    "authorization_token", "tool_configuration"}``) name configured servers by ``name`` (their
    ``url`` is then not reached), or, with ``remote``, a server at ``url``; an ``mcp_toolset``
    tool (``mcp_server_name``, ``default_config``, ``configs``) narrows one."""
    toolsets = {t.get("mcp_server_name"): t for t in tools or () if t.get("type") == "mcp_toolset"}
    out: list[McpUse] = []
    for i, server in enumerate(servers or ()):
        where = f"mcp_servers[{i}]"
        name = server.get("name") if isinstance(server, Mapping) else None
        if not isinstance(name, str) or not name:
            raise RequestInvalid(f"{where}.name must be a non-empty string", param="mcp_servers")
        url = None if name in configured else server.get("url")  # a configured server's url is not reached
        headers = {"Authorization": f"Bearer {server['authorization_token']}"} \
            if url is not None and isinstance(server.get("authorization_token"), str) else {}
        _check_server(name, url, headers, configured, remote, where, "mcp_servers")
        config = server.get("tool_configuration") or {}
        allowed = _allowed(config.get("allowed_tools"), f"{where}.tool_configuration")
        if config.get("enabled") is False:
            allowed = frozenset()
        denied: frozenset[str] = frozenset()
        toolset = toolsets.pop(name, None)
        if toolset is not None:
            allowed, denied = _toolset(toolset, allowed)
        out.append(McpUse(name, name, allowed, denied, url=url, headers=tuple(headers.items())))
    if toolsets:
        raise RequestInvalid(f"an mcp_toolset names {next(iter(toolsets))!r}, which is not in mcp_servers", param="tools")
    return _bounded(out, "mcp_servers")


def offer(uses: Sequence[McpUse], listings: Mapping[str, Iterable[Any]]) -> McpOffer:
    """The function tools for the model, from each used server's listed tools (``McpTool``s)."""
    chosen = [(use, t) for use in uses for t in listings.get(use.server, ()) if use.offers(t.name)]
    counts: dict[str, int] = {}
    for _, t in chosen:
        counts[t.name] = counts.get(t.name, 0) + 1
    tools, routes = [], {}
    for use, t in chosen:
        name = t.name if counts[t.name] == 1 else f"{use.label}_{t.name}"
        routes[name] = McpRoute(use.label, use.server, t.name, use.asks(t.name))
        function: dict[str, Any] = {"name": name, "parameters": dict(t.input_schema) or {"type": "object"}}
        if t.description:
            function["description"] = t.description
        tools.append({"type": "function", "function": function})
    return McpOffer(tuple(uses), tuple(tools), routes)


def tool_message(call_id: str, output: str | None, error: str | None) -> dict[str, Any]:
    """A call's result as the tool turn the model reads next."""
    return {"role": "tool", "tool_call_id": call_id, "content": (output or "") if error is None else f"Error: {error}"}


def _check_server(name: str, url: Any, headers: Mapping[str, Any], configured: Sequence[str], remote: bool,
                  where: str, param: str) -> None:
    if url is None:
        if name not in configured:
            raise RequestInvalid(f"{where}: {name!r} names no configured MCP server ({_known(configured)})", param=param)
        return
    if not remote:
        raise RequestInvalid(
            f"{where}: this server reaches only the MCP servers it was started with (serve --mcp-config), by name "
            f"({_known(configured)}); a request's own server URL needs serve --mcp-urls", param=param,
        )
    if name in configured:
        raise RequestInvalid(f"{where}: {name!r} is a configured MCP server's name; give yours another", param=param)
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestInvalid(f"{where}: an MCP server's URL must be http(s) with a host", param=param)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise RequestInvalid(f"{where}.headers must be an object of strings", param=param)


def _bounded(uses: list[McpUse], param: str) -> tuple[McpUse, ...]:
    if sum(u.url is not None for u in uses) > MAX_REMOTE:
        raise RequestInvalid(f"at most {MAX_REMOTE} MCP servers by URL in one request", param=param)
    return tuple(uses)


def _known(configured: Sequence[str]) -> str:
    return "configured: " + ", ".join(configured) if configured else "none is configured"


def _allowed(value: Any, where: str) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get("tool_names", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestInvalid(f"{where}.allowed_tools must be an array of tool names", param="tools")
    return frozenset(value)


def _approval(tool: Mapping[str, Any], where: str) -> tuple[str, frozenset[str]]:
    """OpenAI's ``require_approval``: ``always`` (its default: ask before anything is shared),
    ``never``, or ``{"always": {"tool_names"}, "never": {"tool_names"}}`` (the tools named
    ``never`` run freely; every other tool asks)."""
    value = tool.get("require_approval", "always")
    if value in ("always", "never"):
        return value, frozenset()
    if isinstance(value, Mapping) and set(value) <= {"always", "never"}:
        always = _allowed(value.get("always"), f"{where}.require_approval.always") or frozenset()
        never = _allowed(value.get("never"), f"{where}.require_approval.never") or frozenset()
        return "always", never - always
    raise RequestInvalid(f"{where}.require_approval must be 'always', 'never' or an object of them", param="tools")


def _toolset(toolset: Mapping[str, Any], allowed: frozenset[str] | None) -> tuple[frozenset[str] | None, frozenset[str]]:
    """An ``mcp_toolset``'s tools: every one (``default_config.enabled``, the default) but those a
    config disables, or only those a config enables."""
    default = (toolset.get("default_config") or {}).get("enabled", True)
    configs = toolset.get("configs") or {}
    if not isinstance(configs, Mapping) or not all(isinstance(c, Mapping) for c in configs.values()):
        raise RequestInvalid("mcp_toolset.configs must be an object of tool names", param="tools")
    enabled = frozenset(n for n, c in configs.items() if c.get("enabled", default))
    if default:
        return allowed, frozenset(configs) - enabled
    return (enabled if allowed is None else enabled & allowed), frozenset()
