"""SIGINT and SIGTERM while models are pulled, imported or loaded: the process exits promptly
and the model store holds no partial model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .realmodels import cached_store, smollm2_store

ROOT = Path(__file__).resolve().parents[1]


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the process did not exit within {timeout} s of the signal") from None


def _wait_for_line(proc: subprocess.Popen[bytes], line: str, timeout: float) -> None:
    """Read the process's stderr until ``line`` (a state it reached), however loaded the machine."""
    assert proc.stderr is not None
    timer = threading.Timer(timeout, proc.kill)  # a process that never gets there is ended
    timer.start()
    try:
        while got := proc.stderr.readline().decode():
            if got.startswith(line):
                return
    finally:
        timer.cancel()
    raise AssertionError(f"the process ended (or {timeout} s passed) before it printed {line!r}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_pull_interrupted_leaves_nothing_behind(tmp_path: Path, signum: int) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "models", "pull", "smollm2-135m-instruct"],
        cwd=ROOT, env={**os.environ, "TURBOSPARK_HOME": str(home)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # as a terminal's Ctrl-C finds it, whatever this run inherited (a shell's background job
        # ignores SIGINT, and so would the child, which would then finish its pull)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    models = home / "models"
    deadline = time.monotonic() + 60
    while not list(models.glob(".tmp-*")):  # the download has begun in a scratch directory
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.skip(f"the pull ended before it could be interrupted: {err.strip()[-300:]}")
        assert time.monotonic() < deadline, "the pull never started"
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signum)
    assert _wait(proc, 30) == 130
    assert b"nothing half-written" in proc.stderr.read()
    assert [p.name for p in models.iterdir()] == []  # no model, no scratch directory


def test_serve_interrupted_while_loading_exits_promptly() -> None:
    smollm2_store()  # in the test cache
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", "--port", "0", "--embedding-model", "none",
         "--stt-model", "none", "--tts-model", "none"],
        cwd=ROOT, env={**os.environ, "TURBOSPARK_HOME": str(cached_store().root.parent)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    _wait_for_line(proc, "turbospark: loading models", 120)  # imports done, signals handled
    proc.send_signal(signal.SIGTERM)
    code = _wait(proc, 30)
    err = proc.stderr.read().decode()
    assert code in (0, 130), err
    assert ("while loading models, exiting" in err) == (code == 130)
    assert not list(cached_store().root.glob(".tmp-*"))


_ENDED_MID_CLEANUP = """
import atexit, os, signal, sys, time
from turbospark.cli.interrupt import _raise, interruptible, leaving
signal.signal(signal.SIGTERM, _raise)  # as python -m turbospark does from its first line
with interruptible():
    print("turbospark: the model is refused", file=sys.stderr, flush=True)
    if sys.argv[1] == "leaving":
        leaving()
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))  # the launcher's
sys.exit(1)
"""


@pytest.mark.parametrize("how", ["leaving", "not leaving"])
def test_a_process_that_said_why_it_ends_is_ended_by_sigterm_quietly(how: str) -> None:
    """What mlx.launch does once one rank exits: SIGTERM the others, which may be in their own
    clean-up by then (an atexit callback, a ``__del__``). After ``leaving`` that ends them with
    SIGTERM's default action and their one line; without it, Python prints the
    ``KeyboardInterrupt`` raised inside the clean-up as a traceback."""
    proc = subprocess.run([sys.executable, "-c", _ENDED_MID_CLEANUP, how], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    if how == "leaving":
        assert proc.returncode == -signal.SIGTERM
        assert proc.stderr == "turbospark: the model is refused\n"
    else:
        assert "Traceback" in proc.stderr and "KeyboardInterrupt: SIGTERM" in proc.stderr
