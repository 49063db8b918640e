"""An optimized BLAS for MLX's CPU backend, without manual steps.

MLX's Linux CPU wheel links a reference (netlib) BLAS.  Its ``cblas_*`` symbols are ordinary
dynamic symbols, so an OpenBLAS loaded first takes their place: fp32 prefill gets ~19x faster and
decode ~2x, with identical results.  The library must be preloaded before the process starts
(``LD_PRELOAD``), so ``serve`` re-executes itself once with it when Debian's
``libopenblas0-pthread`` is installed, and says at startup which BLAS is in use.  Without it,
everything still runs on the reference BLAS.

``OPENBLAS_CORETYPE`` is set from the CPU's flags: OpenBLAS 0.3.21 does not recognise some
current CPUs and falls back to a generic kernel that is 5x slower.  ``OPENBLAS_THREAD_TIMEOUT``
is set to its least (2^4 cycles): by default OpenBLAS's threads spin for some 2^28 cycles (about
0.1 s) after each product, on the cores the CPU kernels' threads then need for the next decode
step; a vision tower's piece (OpenBLAS's products) slowed the step after it.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["describe", "openblas_path", "reexec_with_openblas"]

_MARKER = "TURBOSPARK_BLAS_PRELOADED"


def openblas_path() -> Path | None:
    """Debian's pthread OpenBLAS, if installed (the openmp build is slower on GEMV)."""
    if sys.platform != "linux":
        return None
    machine = platform.machine()
    arch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine)
    if arch is None:
        return None
    path = Path(f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0")
    return path if path.exists() else None


def _core_type() -> str | None:
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
            "",
        ).split()
    except OSError:
        return None
    if "avx512f" in flags:
        return "SkylakeX"
    if "avx2" in flags:
        return "Haswell"
    return None


def reexec_with_openblas(command: Sequence[str]) -> None:
    """Replace this process by ``command`` (itself) with OpenBLAS preloaded, if that helps and is
    possible.

    Returns (doing nothing) when OpenBLAS is absent, already preloaded, refused with
    ``TURBOSPARK_BLAS=reference``, or when MLX is already imported.
    """
    library = openblas_path()
    if (
        library is None
        or os.environ.get(_MARKER)
        or os.environ.get("TURBOSPARK_BLAS") == "reference"
        or "mlx.core" in sys.modules
    ):
        return
    env = dict(os.environ)
    env[_MARKER] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    if "OPENBLAS_CORETYPE" not in env and (core := _core_type()):
        env["OPENBLAS_CORETYPE"] = core
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # its threads sleep after a product, not spin
    sys.stderr.flush()
    os.execve(command[0], list(command), env)


def describe() -> str:
    """Which BLAS MLX's CPU backend uses in this process (call after importing mlx)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for line in maps.splitlines():
        if "libopenblas" in line:
            core = os.environ.get("OPENBLAS_CORETYPE")
            return f"OpenBLAS ({line.split()[-1]}{', core ' + core if core else ''})"
    if "mlx_cpu.libs/libblas" in maps or "libblas" in maps:
        hint = "" if openblas_path() else "; install libopenblas0-pthread for ~19x faster prefill"
        return f"reference BLAS from the MLX wheel{hint}"
    return "unknown"


def main(argv: Sequence[str]) -> None:
    """``python -m turbospark.cli.blas CMD [ARGS]``: run CMD with OpenBLAS preloaded where possible
    (how ``scripts/test`` runs the test suite, so real-model tests run as the server does)."""
    if not argv:
        raise SystemExit("usage: python -m turbospark.cli.blas CMD [ARGS...]")
    reexec_with_openblas([sys.executable, "-m", "turbospark.cli.blas", *argv])
    os.execvp(argv[0], list(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
