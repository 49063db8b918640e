"""A ``python -m turbospark serve`` child on 127.0.0.1 port 0, for the benchmarks that drive a
server from outside: its URL (from the "listening on" line), its resident memory, /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx


class Child:
    def __init__(self, args: Sequence[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turbospark", "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            if m := re.match(r"turbospark listening on (\S+)", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit("the server did not start:\n" + "".join(self.log[-20:]))
        # drained, so a chatty server never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(r"VmRSS:\s+(\d+)", status)
        return int(found.group(1)) / 1024 if found else float("nan")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its name and labels as written."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def gauge(self, name: str) -> float:
        """The sum of a metric's samples over its labels."""
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def close(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=60)
