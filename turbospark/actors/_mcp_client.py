"""The ``mcp`` SDK's client for one server (``actors/mcp.py``): a child process on stdio, or a
streamable-HTTP session; a request's own server (``serve --mcp-urls``) pinned to the public
address it was checked to have."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2

from ..wire.mcp_config import McpServerSpec

__all__ = ["connect"]


@asynccontextmanager
async def connect(spec: McpServerSpec) -> AsyncIterator[Any]:
    """The SDK's client for ``spec``, connected and initialised."""
    from mcp import Client, StdioServerParameters
    from mcp.client.streamable_http import streamable_http_client

    if spec.command is not None:
        target: Any = StdioServerParameters(command=spec.command, args=list(spec.args), env=dict(spec.env) or None,
                                            cwd=spec.cwd)
        async with Client(target) as client:
            yield client
        return
    assert spec.url is not None
    transport = _Pinned(spec.address) if spec.address is not None else None
    async with httpx2.AsyncClient(headers=dict(spec.headers), timeout=httpx2.Timeout(30.0, read=300.0),
                                  transport=transport) as http, \
            Client(streamable_http_client(spec.url, http_client=http)) as client:
        yield client


class _Pinned(httpx2.AsyncBaseTransport):
    """Every request to one checked address, its host kept for ``Host`` and TLS's server name."""

    def __init__(self, address: str) -> None:
        self.address, self.inner = address, httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        request.url = request.url.copy_with(host=self.address)
        request.extensions = {**request.extensions, "sni_hostname": host}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
