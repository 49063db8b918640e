"""http(s) image URLs for vision models (``serve --image-urls``, ``routes/_images.py``): fetched
from public addresses only, from the address checked (the name kept in ``Host`` and TLS's server
name), without redirects, bounded in bytes and time; every refusal a 400 naming the part.  The
network here is closed, so the fetches go to httpx's ``MockTransport`` behind a resolver that
answers a public address; loopback and private names are refused before any connection."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import trio
from PIL import Image

from turbospark.errors import RequestInvalid
from turbospark.routes._images import fetch_image, fetch_images
from turbospark.turns.images import MAX_IMAGE_BYTES

PUBLIC = "93.184.216.34"


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


async def _public(host: str, port: int) -> list[str]:
    return [PUBLIC]


async def test_an_image_is_fetched_from_the_address_checked_with_its_name_kept() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=_png(), headers={"content-type": "image/png"})

    data = await fetch_image("https://images.example/cat.png?size=s", "messages[0] image 1",
                             resolve=_public, transport=httpx.MockTransport(answer))
    assert data == _png()
    (request,) = seen
    assert request.url.host == PUBLIC and request.url.path == "/cat.png" and request.url.query == b"size=s"
    assert request.headers["host"] == "images.example"
    assert request.extensions["sni_hostname"] == "images.example"  # TLS checks the name's certificate


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["10.1.2.3"], ["192.168.0.9"], ["169.254.169.254"], ["::1"],
                                       ["fd00::1"], ["::ffff:127.0.0.1"], [PUBLIC, "127.0.0.1"], ["100.64.0.1"]])
async def test_loopback_private_and_reserved_addresses_are_never_reached(addresses: list[str]) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return addresses

    def answer(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no connection is made")

    with pytest.raises(RequestInvalid, match="public addresses only"):
        await fetch_image("http://sneaky.example/x.png", "messages[0] image 1", resolve=resolve,
                          transport=httpx.MockTransport(answer))


async def test_real_lookups_of_local_names_are_refused() -> None:
    for url in ("http://127.0.0.1:9/x.png", "http://localhost/x.png", "http://[::1]/x.png"):
        with pytest.raises(RequestInvalid, match="public addresses only"):
            await fetch_image(url, "messages[0] image 1")
    with pytest.raises(RequestInvalid, match="must be http"):
        await fetch_image("file:///etc/passwd", "messages[0] image 1")


@pytest.mark.parametrize(("respond", "says"), [
    (lambda r: httpx.Response(302, headers={"location": "http://127.0.0.1/x.png"}), "HTTP 302 (redirects are not followed)"),
    (lambda r: httpx.Response(404), "answered HTTP 404"),
    (lambda r: httpx.Response(200, content=b"<html>not an image</html>"), "not an image this server reads"),
    (lambda r: httpx.Response(200, content=b"\0" * (MAX_IMAGE_BYTES + 1)), "over 20 MiB"),
])  # fmt: skip
async def test_what_comes_back_is_bounded_and_checked(respond, says: str) -> None:
    with pytest.raises(RequestInvalid, match=says.replace("(", r"\(").replace(")", r"\)")):
        await fetch_image("http://images.example/x.png", "messages[1] image 2", resolve=_public,
                          transport=httpx.MockTransport(respond))


async def test_a_slow_server_is_given_up_on() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(5)
        return httpx.Response(200, content=_png())

    with trio.fail_after(3), pytest.raises(RequestInvalid, match="took over 0.2 s"):
        await fetch_image("http://images.example/x.png", "messages[0] image 1", resolve=_public,
                          transport=httpx.MockTransport(slow), seconds=0.2)


async def test_the_image_parts_holding_urls_get_their_files() -> None:
    messages = [{"role": "user", "content": [
        {"type": "image", "url": "http://images.example/a.png", "where": "messages[0] image 1"},
        {"type": "image", "data": b"kept"}, {"type": "text", "text": "hi"}]}]  # fmt: skip
    await fetch_images(messages, resolve=_public,
                       transport=httpx.MockTransport(lambda r: httpx.Response(200, content=_png())))
    assert messages[0]["content"][:2] == [{"type": "image", "data": _png(), "where": "messages[0] image 1"},
                                          {"type": "image", "data": b"kept"}]  # where: for decode_whole's 400s


async def test_the_flag_is_asked_for_and_loopback_urls_are_refused_through_the_server(start_server, client) -> None:
    from turbospark.actors.lifecycle import Loadable
    from turbospark.model.scripted import ScriptedBackend

    vision = Loadable(id="seeing", make=lambda: ScriptedBackend(model_id="seeing"),
                      capabilities=frozenset({"chat", "completion", "vision"}), context_window=2048, size=1)
    body = {"model": "seeing", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]}
    server = await start_server(backends=[], library=[vision])
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and "serve --image-urls" in r.json()["error"]["message"]
    allowed = await start_server(backends=[], library=[vision], image_urls=True)
    r = await client.post(f"{allowed.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0] image 1: the image's host '127.0.0.1' is a loopback")
    r = await client.post(f"{allowed.url}/v1/messages", json={"model": "seeing", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://localhost/x.png"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "public addresses only" in r.json()["error"]["message"]
