"""Which web pages and host names may use the server (sans-io).

A page on any site can send a simple request (a ``text/plain`` POST needs no CORS preflight) to
a server on loopback, and with DNS rebinding read the answer. Two checks close that:

- **Origin.** A browser names the page's origin on every cross-origin request. Requests with an
  ``Origin`` that is not allowed are refused; CORS preflights are answered only for allowed
  origins. The default list is Ollama's (``OLLAMA_ORIGINS``): loopback names on any port, and
  the schemes desktop apps and editors use. Requests without ``Origin`` (every SDK, curl) pass.
- **Host.** Bound to a loopback address, the server answers only requests whose ``Host`` is a
  loopback name or address; a rebound DNS name carries its own ``Host`` and is refused.
"""

from __future__ import annotations

import functools
import ipaddress
import re

from ..config import DEFAULT_ORIGINS

__all__ = ["DEFAULT_ORIGINS", "host_allowed", "is_loopback", "origin_allowed", "parse_origins"]


def parse_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins, ``*`` a wildcard (``*`` alone: any)."""
    return tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    origin = origin.strip().rstrip("/").lower()
    return any(_pattern(p).fullmatch(origin) for p in allowed)


@functools.lru_cache(maxsize=256)
def _pattern(pattern: str) -> re.Pattern[str]:
    """Only ``*`` is special (``[::1]`` is a literal)."""
    return re.compile(".*".join(re.escape(part) for part in pattern.lower().split("*")))


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str | None, bound: str) -> bool:
    """Whether a request's ``Host`` may reach a server bound to ``bound``: anything when bound
    beyond loopback, else only loopback names and addresses (a missing ``Host`` passes)."""
    if not host_header or not is_loopback(bound):
        return True
    name = host_header.strip()
    if name.startswith("["):
        name = name[: name.find("]") + 1]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    return is_loopback(name)
