"""Claude Code (the ``@anthropic-ai/claude-code`` npm package), installed once into the test
cache and run in print mode against a server.  A test that needs it skips, with the reason, only
when npm is missing or its registry cannot be reached."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

__all__ = ["run_claude", "run_claude_stock"]

PACKAGE = "@anthropic-ai/claude-code"


@functools.cache
def _claude() -> Path:
    prefix = Path(os.environ.get("TURBOSPARK_TEST_HOME", Path(__file__).parent / ".cache")) / "claude-code"
    binary = prefix / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("Claude Code needs npm, which is not installed")
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--silent", "--prefix", str(prefix), PACKAGE],
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
