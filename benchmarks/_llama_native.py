"""llama.cpp's own binaries (``llama-server``, ``llama-bench``, ``llama-quantize``) built for
this CPU (``GGML_NATIVE``: every instruction set it has, AVX-512 and VNNI included), for the
benchmarks that compare against llama.cpp at its best rather than through llama-cpp-python's
portable wheel build.  The sources are the ``vendor/llama.cpp`` tree of the pinned
llama-cpp-python sdist (the same llama.cpp the tests check against), fetched with pip when it is
not cached; the build (static, Release, no curl, no web UI download) goes to
``tests/.cache/llama-cpp/native-<version>/`` and is kept: a later call finds the binaries there
and builds nothing (the first build took 7 minutes on 2 cores, at nice 15).

    python benchmarks/_llama_native.py     # build once, print the build's version and CPU features
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.3.36"  # llama-cpp-python, as tests/model/gguf_fixtures.py pins it
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CACHE = ROOT / "tests" / ".cache" / "llama-cpp"
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
_PREFIX = f"llama_cpp_python-{VERSION}/"
_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no npm, no download: the server's bare page
]  # fmt: skip


@dataclass(frozen=True)
class NativeLlamaCpp:
    """The three binaries of one native build."""

    server: Path
    bench: Path
    quantize: Path

    def build_info(self) -> str:
        """``version: 0.5.0-dev (build 0, commit 0c1e570) | built with ... | CPU : SSE3 = 1 | ... |
        AVX512 = 1 | ...``: what ``llama-server --version`` prints (the build number is 0: the
        sdist holds no history to count) and the CPU backend's features, as the ``system_info``
        line of llama.cpp's logs names them."""
        version = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, check=False)
        lines = [line for line in (version.stdout + version.stderr).splitlines() if line.strip()]
        # llama-server logs system_info (at verbosity 4) before it loads a model: none is needed
        probe = subprocess.run([str(self.server), "-m", os.devnull, "--port", "0", "-t", "1", "-lv", "4"],
                               capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        features = re.search(r"system_info:.*?(CPU : .*?)\s*$", probe.stdout + probe.stderr, re.M)
        return " | ".join([*lines, features.group(1).rstrip(" |") if features else "CPU features: unknown"])


def sdist(cache: Path = CACHE) -> Path:
    """The pinned llama-cpp-python sdist, downloaded with pip the first time, checked against its
    pinned sha256."""
    target = cache / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not target.is_file():
        command = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}",
                   "--no-binary", ":all:", "--no-deps", "-d", str(target.parent)]  # fmt: skip
        subprocess.run(command, check=True)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{target} has sha256 {digest}, not the pinned {SDIST_SHA256}")
    return target


def _extract(archive: Path, into: Path) -> None:
    """The sdist's ``vendor/llama.cpp`` files into ``into`` (its ``.git`` link left out)."""
    prefix = _PREFIX + "vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        for member in tar:
            name = member.name.removeprefix(prefix)
            if member.isfile() and member.name.startswith(prefix) and name != ".git":
                target = into / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, target.open("wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst)
                target.chmod(member.mode & 0o755 | 0o644)


def _commit(archive: Path) -> str:
    """The llama.cpp commit the sdist vendors (its submodule's HEAD), short, or "unknown"."""
    with tarfile.open(archive) as tar:
        try:
            head = tar.extractfile(_PREFIX + ".git/modules/vendor/llama.cpp/HEAD")
        except KeyError:
            return "unknown"
        text = head.read().decode().strip() if head else ""
    return text[:7] if re.fullmatch(r"[0-9a-f]{40}", text) else "unknown"


def native_llama_cpp(cache: Path | None = None) -> NativeLlamaCpp:
    """The native build under ``cache`` (default ``tests/.cache/llama-cpp``), built the first time
    (nice'd, on every core), with its progress on stderr."""
    cache = cache or CACHE
    home = cache / f"native-{VERSION}"
    bins = home / "build" / "bin"
    paths = [bins / target for target in TARGETS]
    if not all(path.is_file() for path in paths):
        archive = sdist(cache)
        source = home / "src"
        if not (source / "CMakeLists.txt").is_file():
            shutil.rmtree(source, ignore_errors=True)
            _extract(archive, source)
        nice = ["nice", "-n", "15"] if shutil.which("nice") else []
        jobs = str(os.cpu_count() or 1)
        # the sources are no git checkout: keep cmake's git from finding an enclosing one (this
        # repository's), whose commit and count it would report as llama.cpp's and ggml's
        env = os.environ | {"GIT_CEILING_DIRECTORIES": str(home.resolve())}
        t0 = time.perf_counter()
        subprocess.run([*nice, "cmake", "-S", str(source), "-B", str(home / "build"), *_CMAKE_FLAGS,
                        f"-DLLAMA_BUILD_COMMIT={_commit(archive)}"], env=env, check=True)  # fmt: skip
        subprocess.run([*nice, "cmake", "--build", str(home / "build"), "--config", "Release", "-j", jobs,
                        "--target", *TARGETS], env=env, check=True)  # fmt: skip
        print(f"built llama.cpp natively in {time.perf_counter() - t0:.0f} s: {bins}", file=sys.stderr)
    return NativeLlamaCpp(*paths)


if __name__ == "__main__":
    built = native_llama_cpp()
    print(f"llama-server: {built.server}\nllama-bench: {built.bench}\nllama-quantize: {built.quantize}")
    print(built.build_info())
