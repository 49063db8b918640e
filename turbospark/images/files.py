"""Generated images kept for ``response_format: url`` (sans-io): a random name each, for a
limited time, bounded in bytes.

An image is served at ``/v1/images/files/<name>`` for ``KEEP_SECONDS`` after it was made; the
names are 128 random bits (unguessable: the URL is the capability, as OpenAI's signed URLs are).
At most ``MAX_BYTES`` are kept: the oldest go first.  Time is passed in, never read here; the
store is read and written only on the Trio thread.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

__all__ = ["ImageFiles", "KEEP_SECONDS", "MAX_BYTES"]

KEEP_SECONDS = 3600.0
MAX_BYTES = 256 * 1024 * 1024
_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


class ImageFiles:
    def __init__(self, *, keep_seconds: float = KEEP_SECONDS, max_bytes: int = MAX_BYTES) -> None:
        self.keep_seconds = keep_seconds
        self.max_bytes = max_bytes
        self._files: OrderedDict[str, tuple[bytes, str, float]] = OrderedDict()
        self._bytes = 0

    def put(self, data: bytes, output_format: str, now: float) -> str:
        """Keep ``data``; the name it is served under (``<random>.<format>``)."""
        self._expire(now)
        name = f"{secrets.token_urlsafe(16)}.{output_format}"
        self._files[name] = (data, _TYPES[output_format], now + self.keep_seconds)
        self._bytes += len(data)
        while self._bytes > self.max_bytes and len(self._files) > 1:
            _, (old, _, _) = self._files.popitem(last=False)
            self._bytes -= len(old)
        return name

    def get(self, name: str, now: float) -> tuple[bytes, str] | None:
        """The image's bytes and content type, or None when it is unknown or has expired."""
        self._expire(now)
        found = self._files.get(name)
        return None if found is None else (found[0], found[1])

    def _expire(self, now: float) -> None:
        while self._files:
            name, (data, _, until) = next(iter(self._files.items()))
            if until > now:
                break
            del self._files[name]
            self._bytes -= len(data)
