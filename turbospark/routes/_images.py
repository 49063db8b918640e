"""Image URLs fetched for a vision model (``serve --image-urls``): public addresses only, bounded.

A message's image part that holds an http(s) ``url`` (``turns.images.with_images`` leaves it so
when the server allows URLs) is fetched here, in the request's scope, before the prompt is sent:

- the host is resolved first, and every address it resolves to must be a public one (not
  loopback, private, link-local, shared, reserved or multicast): the server never reaches what
  only it could reach;
- the request goes to the address checked, not to a second lookup (the ``Host`` header and TLS's
  server name keep the name), so the name cannot be rebound to a private address in between;
- redirects are not followed (one could lead anywhere); the answer must be a 200 of at most
  ``MAX_IMAGE_BYTES``, all within ``FETCH_S`` seconds;
- what arrives is checked as an uploaded image is (``turns.images.checked``).

Every refusal is a 400 naming the part; the client's own cancellation ends a fetch at once.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio

from ..errors import RequestInvalid
from ..turns.images import MAX_IMAGE_BYTES, checked

__all__ = ["FETCH_S", "fetch_image", "fetch_images"]

#: A fetch's whole time: resolving, connecting, reading.
FETCH_S = 10.0

Resolve = Callable[[str, int], Awaitable[list[str]]]


async def _resolve(host: str, port: int) -> list[str]:
    found = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return [str(info[4][0]) for info in found]


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def fetch_image(url: str, where: str, *, resolve: Resolve = _resolve,
                      transport: httpx.AsyncBaseTransport | None = None, seconds: float = FETCH_S) -> bytes:
    """The image at ``url`` (http or https, on a public address), checked."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestInvalid(f"{where}: an image URL must be http(s) with a host", param="messages")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    with trio.move_on_after(seconds) as deadline:
        try:
            addresses = await resolve(parts.hostname, port)
        except OSError:
            raise RequestInvalid(f"{where}: the image's host {parts.hostname!r} was not found", param="messages") from None
        if not addresses or not all(_public(a) for a in addresses):
            raise RequestInvalid(f"{where}: the image's host {parts.hostname!r} is a loopback, private or reserved "
                                 "address; this server fetches images from public addresses only", param="messages")
        ip = addresses[0]
        target = parts._replace(netloc=f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}").geturl()
        headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*"}
        extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
        async with httpx.AsyncClient(transport=transport, follow_redirects=False, timeout=seconds) as client:
            try:
                async with client.stream("GET", target, headers=headers, extensions=extensions) as answer:
                    if answer.status_code != 200:
                        raise RequestInvalid(f"{where}: fetching the image answered HTTP {answer.status_code}"
                                             + (" (redirects are not followed)" if answer.is_redirect else ""),
                                             param="messages")
                    data = bytearray()
                    async for chunk in answer.aiter_bytes():
                        data += chunk
                        if len(data) > MAX_IMAGE_BYTES:
                            raise RequestInvalid(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB",
                                                 param="messages")
            except httpx.HTTPError as exc:
                raise RequestInvalid(f"{where}: the image could not be fetched ({type(exc).__name__})",
                                     param="messages") from None
    if deadline.cancelled_caught:
        raise RequestInvalid(f"{where}: fetching the image took over {seconds:g} s", param="messages")
    return checked(bytes(data), where)


async def fetch_images(messages: Iterable[Mapping[str, Any]], **kwargs: Any) -> None:
    """Fill every image part that holds a ``url`` with its file (``data``), one after another."""
    for m in messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            if isinstance(part, dict) and part.get("type") == "image" and "url" in part:
                part["data"] = await fetch_image(part.pop("url"), part.setdefault("where", "messages"), **kwargs)
