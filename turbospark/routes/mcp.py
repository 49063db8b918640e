"""``GET /v1/mcp/tools``: every configured MCP server (``serve --mcp-config``), its state and its
tools, as the web page and a client choosing ``mcp`` tools read them.  What a stdio server runs
(its command line, its environment) and an HTTP server's headers are not shown."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..actors.mcp import McpListing
from ..web.app import json_response, system

__all__ = ["blueprint", "server_json"]

blueprint = Blueprint("mcp", __name__)


def server_json(listing: McpListing) -> dict[str, Any]:
    return {
        "object": "mcp_server", "name": listing.server, "transport": listing.transport, "state": listing.state,
        "error": listing.error, "tools": [tool.wire() for tool in listing.tools],
    }


@blueprint.get("/v1/mcp/tools")
async def mcp_tools() -> Response:
    return json_response({"object": "list", "data": [server_json(one) for one in await system().mcp.listings()]})
