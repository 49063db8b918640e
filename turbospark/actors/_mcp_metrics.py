"""The MCP tool calls' series in ``/metrics`` (the observer's, kept apart to keep it short).

- ``turbospark_mcp_calls{server,outcome}``: calls ended: ``ok``, ``error`` (the tool said so),
  ``timeout``, ``cancelled`` (the client left), ``failed`` (the server could not run it);
- ``turbospark_mcp_call_seconds{server}``: how long they ran.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Summary

from .mcp import McpCalled

__all__ = ["McpMetrics"]


class McpMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.calls = Counter("turbospark_mcp_calls", "MCP tool calls ended, by server and outcome",
                             ["server", "outcome"], registry=reg)
        self.seconds = Summary("turbospark_mcp_call_seconds", "Time MCP tool calls ran", ["server"], registry=reg)

    def record(self, event: McpCalled) -> None:
        self.calls.labels(event.server, event.outcome).inc()
        self.seconds.labels(event.server).observe(event.seconds)
