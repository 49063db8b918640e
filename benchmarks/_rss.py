"""A process's own peak resident memory, for benchmarks that compare processes.

``getrusage(RUSAGE_SELF).ru_maxrss`` is not a child's own peak on Linux: exec keeps the high-water
mark of the memory it replaced, so a child started by a driver that holds 450 MB reports at least
450 MB whatever it holds itself (measured: 513 MB reported by a child whose peak was 14 MB).  The
kernel's ``VmHWM`` in ``/proc/PID/status`` is the peak of the process's own memory.  Standard
library only: llama.cpp's child runs in a venv of its own.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path


def peak_rss_mb(pid: int | str = "self") -> float:
    """The peak resident memory of process ``pid`` (this one by default), in MB: ``VmHWM`` where
    Linux says it, else this process's ``ru_maxrss``."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        found = re.search(r"VmHWM:\s+(\d+)", status.read_text())
        if found:
            return int(found.group(1)) / 1024
    if pid != "self":
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere
