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

__all__ = ["run_claude"]

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
        done = await trio.run_process(
            [str(binary), "--bare", "-p", prompt, "--system-prompt", "Be brief.", "--tools", tools, *extra],
            env=env, capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()
