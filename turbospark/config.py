"""Settings for one server process."""

from __future__ import annotations

import os
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
    max_batch: int = 16  # sequences a model runs at once
    kv_budget: int = 2 << 30  # bytes of KV cache a model's running sequences may grow to
    events_path: Path | None = None
    script: str | None = None
    token_delay: float = 0.0
    graceful_timeout: float = 5.0
    keepalive_interval: float = 15.0
    max_body_bytes: int = 25 * 1024 * 1024

    @staticmethod
    def max_batch_default() -> int:
        """What ``benchmarks/bench_batch.py`` shows is best on CPU (see the README): 16 streams
        give 1.6x the aggregate throughput of 8, each stream keeping over 80 % of its pace."""
        return 16

    @staticmethod
    def kv_budget_default() -> int:
        """A quarter of physical memory."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        except (ValueError, OSError, AttributeError):
            return 2 << 30
