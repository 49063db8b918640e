"""``serve --mcp-config FILE``: the ``mcpServers`` file that Claude Desktop, Cursor and LM Studio
share, read into the servers' specs (sans-io).

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}},
        "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server with ``command`` runs as a child process on stdio; one with ``url`` is reached over
streamable HTTP.  ``"disabled": true`` leaves one out; ``"timeout"`` (seconds) bounds each of its
tool calls (default ``CALL_TIMEOUT_S``); ``"type"`` may say ``stdio``, ``http`` or
``streamable-http`` (SSE servers are refused: the transport is deprecated).  Every mistake is a
``ValueError`` naming the server and the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

__all__ = ["CALL_TIMEOUT_S", "McpServerSpec", "parse_mcp_config", "read_mcp_config"]

#: A tool call's bound where the file sets none: past it the call is an error, never a stuck response.
CALL_TIMEOUT_S = 60.0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@attrs.frozen
class McpServerSpec:
    """One MCP server: a child process (``command``) or a streamable-HTTP endpoint (``url``)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)
    timeout: float = CALL_TIMEOUT_S
    #: a request's server (``serve --mcp-urls``): the public address its host was checked to have,
    #: which every connection goes to (the name cannot be rebound in between)
    address: str | None = None

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


def read_mcp_config(path: str | Path) -> tuple[McpServerSpec, ...]:
    """The servers ``path`` names, in its order."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    return parse_mcp_config(data)


def parse_mcp_config(data: Any) -> tuple[McpServerSpec, ...]:
    if not isinstance(data, Mapping) or not isinstance(data.get("mcpServers"), Mapping):
        raise ValueError('an MCP config is an object with "mcpServers": {"NAME": {...}, ...}')
    out = []
    for name, entry in data["mcpServers"].items():
        if not _NAME.match(name):
            raise ValueError(f"MCP server name {name!r}: letters, digits, '_', '.' and '-' only (at most 64)")
        if not isinstance(entry, Mapping):
            raise ValueError(f"MCP server {name!r}: its entry must be an object")
        if entry.get("disabled") is True:
            continue
        out.append(_server(name, entry))
    return tuple(out)


def _server(name: str, entry: Mapping[str, Any]) -> McpServerSpec:
    where = f"MCP server {name!r}"
    kind = entry.get("type", "stdio" if "command" in entry else "http")
    if kind == "sse":
        raise ValueError(f"{where}: SSE servers are not supported (a deprecated transport); use streamable HTTP")
    if kind not in ("stdio", "http", "streamable-http", "streamableHttp"):
        raise ValueError(f"{where}: type must be 'stdio', 'http' or 'streamable-http', got {kind!r}")
    timeout = entry.get("timeout", CALL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
        raise ValueError(f"{where}: timeout is seconds, more than 0 and at most 3600, got {timeout!r}")
    if kind == "stdio":
        command, args = entry.get("command"), entry.get("args", [])
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"{where}: a stdio server needs a \"command\" string")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: \"args\" must be an array of strings")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError(f"{where}: \"cwd\" must be a string")
        return McpServerSpec(name, command=command, args=tuple(args), env=_strings(entry, "env", where),
                             cwd=cwd, timeout=float(timeout))
    url = entry.get("url")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise ValueError(f"{where}: an HTTP server needs an http(s) \"url\", got {url!r}")
    return McpServerSpec(name, url=url, headers=_strings(entry, "headers", where), timeout=float(timeout))


def _strings(entry: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{where}: \"{key}\" must be an object of strings")
    return dict(value)
