"""``docs/configuration.md``, written from the command-line parsers themselves, so the page
cannot drift from them: every ``serve`` flag with its help and default, the ``models``
subcommands, and the environment variables the server and its tools read.

    python -m turbospark.cli.reference            # print the page
    python -m turbospark.cli.reference --write    # write docs/configuration.md

``tests/test_docs.py`` checks the page equals what this prints, and that every
``TURBOSPARK_*`` variable the code, scripts and tests read is listed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .args import build_parser

__all__ = ["ENVIRONMENT", "TEST_ENVIRONMENT", "configuration_page"]

#: Every environment variable turbospark reads, and what it does.
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("TURBOSPARK_HOME", "where the model store lives: `$TURBOSPARK_HOME/models` (default "
     "`${XDG_CACHE_HOME:-~/.cache}/turbospark/models`)"),
    ("TURBOSPARK_API_KEY", "the API key, when `--api-key` is not given (a blank value is refused)"),
    ("TURBOSPARK_ORIGINS", "the allowed web origins, when `--allowed-origins` is not given"),
    ("TURBOSPARK_BLAS", "`reference` keeps the BLAS of MLX's wheel instead of preloading OpenBLAS"),
    ("TURBOSPARK_BLAS_PRELOADED", "set by turbospark itself when it re-executes with OpenBLAS preloaded; "
     "not for users"),
    ("TURBOSPARK_KERNELS", "`off` (or `0`, `mlx`) serves with MLX's own CPU ops instead of turbospark's "
     "kernels ([performance.md](performance.md))"),
    ("TURBOSPARK_KERNELS_EXACT", "`1` keeps x in float32 in quantized products and the KV cache in "
     "float32 (bit-for-bit closer to MLX's own ops, slower; decisions 0028, 0035)"),
    ("TURBOSPARK_KERNELS_PACKED", "`0` keeps 4- and 8-bit weights in MLX's layout instead of packing them "
     "eight output rows together for the kernels (slower; for comparisons, decision 0039)"),
    ("TURBOSPARK_KV_CACHE", "the fused layers' KV cache: `f16` (the default with the kernels, as llama.cpp's; "
     "decision 0035), `q8_0` or `q4_0` (llama.cpp's blocks: 0.53x and 0.28x the bytes, decision 0047; "
     "`serve --kv-cache` sets it too), or `float32` (`TURBOSPARK_KERNELS_EXACT=1` keeps float32 too)"),
    ("TURBOSPARK_MCP_CONFIG", "the MCP servers' `mcpServers` file, when `--mcp-config` is not given (decision 0049)"),
    ("TURBOSPARK_KERNELS_ISA", "the CPU kernels' instruction set, one of those this CPU runs (`avx2+avx512vnni`, "
     "`avx2+vnni`, `avx2+fma`, `portable`, `neon`; default: the best); another turns the kernels off and the "
     "startup line says why. `scripts/test` runs the kernels' tests on each (decision 0040)"),
    ("TURBOSPARK_KERNEL_THREADS", "the CPU kernels' team size (default: one thread per core this "
     "process may use)"),
    ("TURBOSPARK_KERNEL_STEP_THREADS", "how many of that team a decode step's quantized products and "
     "attention take (default: all of it; decision 0031)"),
    ("TURBOSPARK_KERNEL_SPIN_US", "how long the kernels' idle threads spin before sleeping, in "
     "microseconds (default 200)"),
    ("TURBOSPARK_FAULTS", "fault injection for the test suite (`point[:times],...`); never set it "
     "in production"),
    ("OLLAMA_MODELS", "where Ollama's store is, for `models list --ollama` and `ollama:` imports "
     "(default `~/.ollama/models`)"),
    ("OPENBLAS_CORETYPE", "OpenBLAS's kernel set; where turbospark preloads OpenBLAS it sets this from the CPU "
                          "(Haswell where the CPU has AVX2, SkylakeX with AVX-512), and keeps a value you give"),
    ("MLX_RING_PORT", "`scripts/serve-distributed`: the ranks' first port (default 32323)"),
    ("SERVE_DISTRIBUTED_STOP_TIMEOUT", "`scripts/serve-distributed`: how many seconds after SIGTERM or SIGINT "
     "the ranks have to stop before what is left is killed (default 30; [deployment.md](deployment.md))"),
)

#: What only the test suite reads.
TEST_ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("TURBOSPARK_TEST_HOME", "the test cache: real models, Claude Code, llama.cpp (default `tests/.cache`)"),
    ("LLAMA_CPP_VENV", "`scripts/check-against-llama-cpp`: the venv it builds llama-cpp-python into, or uses "
                       "(default `tests/.cache/llama-cpp/venv`)"),
    ("TURBOSPARK_LLAMA_CPP_PYTHON", "the Python with llama-cpp-python that the comparison tests run "
     "(`scripts/check-against-llama-cpp` sets it; without it they skip)"),
    ("TURBOSPARK_FUZZ_EXAMPLES", "examples per route for the OpenAPI fuzz test (default 25)"),
    ("TURBOSPARK_CHROMIUM", "the Chromium the web page's browser tests drive (default: `chromium` on `PATH`)"),
    ("TURBOSPARK_SCREENSHOTS", "where the browser tests save screenshots (default `tests/.screenshots`)"),
)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action, *, escaped: bool = True) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (action.dest.upper() if not action.choices else "|".join(action.choices))
    flag = f"{names} `{metavar}`"
    return flag.replace("|", "\\|") if escaped else flag


def _serve_rows(serve: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in serve._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        rows.append(f"| {_flag(action)} | {_cell(action.help or '')} |")
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """A parser's subcommands: name -> (parser, its help line)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().removeprefix("usage: ").replace(" [-h]", "").split())


def configuration_page() -> str:
    from .models import _parser as models_parser

    serve = _subparsers(build_parser())["serve"][0]
    lines = [
        "# Configuration",
        "",
        "<!-- Written by `python -m turbospark.cli.reference --write` from the parsers themselves;",
        "     tests/test_docs.py fails when it differs. Edit the parsers' help, not this page. -->",
        "",
        "Every flag of `python -m turbospark serve`, from its own parser. `serve --help` prints",
        "the same. Flags that take a model name take a stored id, a catalogue name or a path to",
        "import first ([models.md](models.md)).",
        "",
        "| flag | meaning |",
        "| --- | --- |",
        *_serve_rows(serve),
        "",
        "## `models`",
        "",
        "`python -m turbospark models COMMAND` manages the model store ([models.md](models.md)):",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for sub, what in _subparsers(models_parser()).values():
        flags = [f"{_flag(a, escaped=False)}: {' '.join((a.help or '').split())}" for a in sub._actions
                 if a.option_strings and "--help" not in a.option_strings]
        lines.append(f"| `{_usage(sub)}` | {_cell('; '.join([what, *flags]))} |")
    lines += [
        "",
        "## Environment",
        "",
        "| variable | meaning |",
        "| --- | --- |",
        *(f"| `{name}` | {_cell(text)} |" for name, text in ENVIRONMENT),
        "",
        "Read only by the test suite:",
        "",
        "| variable | meaning |",
        "| --- | --- |",
        *(f"| `{name}` | {_cell(text)} |" for name, text in TEST_ENVIRONMENT),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = configuration_page()
    if argv == ["--write"]:
        target = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
        target.write_text(page, encoding="utf-8")
        print(f"wrote {target}")
    elif argv:
        print("usage: python -m turbospark.cli.reference [--write]", file=sys.stderr)
        return 2
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
