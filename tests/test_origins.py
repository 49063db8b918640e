"""Other websites and rebound host names cannot use the server; SDKs and local pages can."""

from __future__ import annotations

import pytest

from turbospark.web.origins import DEFAULT_ORIGINS, host_allowed, origin_allowed, parse_origins

from ._support import chat_body


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("http://localhost:3000", True), ("http://127.0.0.1", True), ("https://[::1]:8443", True),
        ("vscode-webview://abc", True), ("https://evil.example", False),
        ("http://localhost.evil.example", False), ("null", False),
    ],
)
def test_default_origins(origin: str, allowed: bool) -> None:
    assert origin_allowed(origin, DEFAULT_ORIGINS) is allowed


def test_origin_lists_and_hosts() -> None:
    assert parse_origins("https://app.example.com, http://*.corp:*/") == ("https://app.example.com", "http://*.corp:*")
    assert origin_allowed("http://a.corp:81", parse_origins("http://*.corp:*"))
    assert origin_allowed("https://anything", ("*",))
    for host in ("localhost:8080", "127.0.0.1", "127.0.0.2:1", "[::1]:8080", "app.localhost"):
        assert host_allowed(host, "127.0.0.1"), host
    for host in ("evil.example", "evil.example:8080", "192.168.1.5", "[2001:db8::1]:80"):
        assert not host_allowed(host, "127.0.0.1"), host
    assert host_allowed("evil.example", "0.0.0.0")  # bound beyond loopback: the owner's choice
    assert host_allowed(None, "::1")


async def test_foreign_origins_and_hosts_are_refused_in_each_family_shape(start_server, client) -> None:
    server = await start_server()
    evil = {"Origin": "https://evil.example"}
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=1), headers=evil)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert "access-control-allow-origin" not in r.headers
    r = await client.post(f"{server.url}/v1/messages", json={"messages": []}, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error" and r.json()["type"] == "error"
    r = await client.post(f"{server.url}/api/embed", json={"input": "x"}, headers=evil)
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
    # the classic drive-by: a text/plain POST with no preflight
    r = await client.post(f"{server.url}/v1/chat/completions", content=b'{"messages":[]}',
                          headers=evil | {"Content-Type": "text/plain"})
    assert r.status_code == 403
    for path in ("/health", "/metrics"):
        assert (await client.get(f"{server.url}{path}", headers=evil)).status_code == 403
    r = await client.get(f"{server.url}/v1/models", headers={"Host": "rebound.example.com"})
    assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
    r = await client.options(f"{server.url}/v1/chat/completions",
                             headers=evil | {"Access-Control-Request-Method": "POST"})
    assert r.status_code == 403


async def test_local_pages_get_cors_and_sdks_pass(start_server, client) -> None:
    server = await start_server()
    local = {"Origin": "http://localhost:5173"}
    r = await client.options(f"{server.url}/v1/chat/completions", headers=local | {
        "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type, authorization"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert r.headers["access-control-allow-headers"] == "content-type, authorization"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=1), headers=local)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=1))
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    other = await start_server(allowed_origins=("https://app.example.com",))
    r = await client.get(f"{other.url}/v1/models", headers={"Origin": "https://app.example.com"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert (await client.get(f"{other.url}/v1/models", headers=local)).status_code == 403
