"""A small MCP server written with the official SDK: the one docs/mcp.md serves."""

from mcp.server.mcpserver import MCPServer

app = MCPServer("weather")


@app.tool()
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


@app.tool()
def get_time(city: str) -> str:
    """The time of day in a city."""
    return f"It is noon in {city}."


if __name__ == "__main__":
    app.run()
