"""Settings for one server process."""

from __future__ import annotations

from pathlib import Path

import attrs

__all__ = ["Settings"]


@attrs.frozen
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    models: tuple[str, ...] = ()
    api_key: str | None = None
    system_prompt: str | None = None
    max_queue: int = 16
    max_resolutions: int = 4
    events_path: Path | None = None
    script: str | None = None
    token_delay: float = 0.0
    graceful_timeout: float = 5.0
    keepalive_interval: float = 15.0
    max_body_bytes: int = 25 * 1024 * 1024
