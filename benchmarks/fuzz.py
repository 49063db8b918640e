"""The test suite's fuzzer, for longer: every route, many more examples.

    python benchmarks/fuzz.py [--examples 2000] [-k PATTERN]

It runs ``tests/test_fuzz.py`` (the same properties: no 5xx, no hang, every answer in its
documented shape) with ``TURBOSPARK_FUZZ_EXAMPLES`` examples per route instead of the suite's 25.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("-k", default=None, help="only the routes whose test id matches")
    args = parser.parse_args()
    command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, "-m", "pytest", "-q",
               "-p", "no:cacheprovider", str(ROOT / "tests" / "test_fuzz.py")]
    if args.k:
        command += ["-k", args.k]
    env = {**os.environ, "TURBOSPARK_FUZZ_EXAMPLES": str(args.examples)}
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
