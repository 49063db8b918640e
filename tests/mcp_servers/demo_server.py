"""A small MCP server written with the official SDK, as a user writes one: the tests name it in an
``mcpServers`` file.  ``python demo_server.py`` serves stdio; ``--http PORT`` streamable HTTP;
any other arguments are ignored (a test tags its children with one, to find them).

``slow`` writes ``cancelled`` to the file ``$MCP_DEMO_MARKS`` names when the client cancels it, and
``started`` when it begins, so a test sees what the server saw."""

from __future__ import annotations

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer

app = MCPServer("demo")


def _mark(what: str) -> None:
    path = os.environ.get("MCP_DEMO_MARKS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(what + "\n")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    _mark(f"add {a} {b}")
    return a + b


@app.tool()
def shout(text: str) -> str:
    """Return the text in capital letters."""
    _mark(f"shout {text}")
    return text.upper()


@app.tool()
async def slow(seconds: float) -> str:
    """Wait the given number of seconds, then say done."""
    _mark("started")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        _mark("cancelled")
        raise
    return "done"


@app.tool()
def broken() -> str:
    """Always fails."""
    raise RuntimeError("the disk is on fire")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
