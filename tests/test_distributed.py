"""``serve --distributed``: one model sharded over 2 ranks (``scripts/serve-distributed 2``,
``mlx.launch``'s ring backend on loopback) answers with the same greedy text as one process; a
client that leaves stops its sequence (on every rank: they run in lockstep); a rank that dies or
cannot be reached (stopped) gets the requests in flight and new ones a retryable 503 and ends the
run with a non-zero status instead of a hang; SIGTERM or SIGINT to the script stops every rank (rank
0 gracefully), killed after a bound if need be, and leaves no process behind; a model whose heads do
not split is refused."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .model.tiny import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
NO_EXTRAS = ["--embedding-model", "none", "--stt-model", "none", "--tts-model", "none"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.url = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if m := re.match(r"turbospark listening on (\S+)", line):
                self.url = m[1]
                break
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        assert self.url, "".join(self.lines)

    def said(self, *parts: str, count: int) -> bool:
        """Whether ``count`` messages holding every one of ``parts`` came, within 30 s (a rank other
        than 0 may say what it holds after rank 0 is listening).  A message begins with
        ``turbospark:``: ranks write to one stream, and two may land on one line (one rank's
        text before the other's newline)."""
        deadline = time.monotonic() + 30

        def messages() -> list[str]:
            return [m for line in list(self.lines) for m in re.split(r"(?=turbospark:)", line)]

        while (seen := sum(all(p in m for p in parts) for m in messages())) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return seen == count

    def follower_pid(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := re.search(r"rank 1 of \d+ holds its shard of \S+ \(pid (\d+)\)", line):
                    return int(m[1])
            time.sleep(0.1)
        raise AssertionError("".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _ring_port(ranks: int = 4) -> int:
    """The first of ``ranks`` consecutive free ports, below Linux's ephemeral range (32768 on): a
    block inside it can be taken by any connection's local port between this check and the ranks'
    binds (``[ring] Couldn't bind socket``)."""
    while True:
        first = random.randrange(20000, 32000)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + ranks):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {**os.environ, "TURBOSPARK_HOME": str(tmp_path / "home"), "MLX_RING_PORT": str(_ring_port())}


def _serve(env: dict[str, str], model: Path, ranks: int | None, *more: str) -> Running:
    flags = ["--model", str(model), "--port", str(_port()), *NO_EXTRAS, *more]
    if ranks is None:
        return Running([sys.executable, "-m", "turbospark", "serve", *flags], env)
    return Running([str(ROOT / "scripts" / "serve-distributed"), str(ranks), *flags], env)


QUESTIONS = ["Hello there", "Tell me a story about the sea", "1 2 3 4"]


def _answers(url: str) -> list[str]:
    out = []
    with httpx.Client(timeout=120) as client:
        for q in QUESTIONS:
            body = {"model": "any", "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
            r = client.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["message"]["content"])
            with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as s:
                text = "".join(s.iter_text())
            assert text.rstrip().endswith("data: [DONE]")
            out.append(text.count("data: {"))
    return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize(("shard", "ranks"), [("tensor", 2), ("pipeline", 3)])
def test_ranks_answer_as_one_process_and_stop_a_client_that_left(env, tmp_path: Path, shard: str, ranks: int) -> None:
    """By heads over 2 ranks (the tiny model's 4 and 2 divide), by layers over 3 (one each: the
    middle rank receives and sends)."""
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model, layers=3)
    single = _serve(env, model, None)
    try:
        expected = _answers(single.url)
    finally:
        single.stop()
    sharded = _serve(env, model, ranks, "--shard", shard)
    try:
        assert sharded.said("holds its shard of tiny-llama", f"({shard} sharding)", count=ranks), "".join(sharded.lines)
        assert _answers(sharded.url) == expected
        # a client that leaves mid-stream: its sequence is cancelled (on both ranks, in lockstep)
        body = {"model": "any", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{sharded.url}/v1/chat/completions", json=body) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 30
        while _metric(sharded.url, "turbospark_cancellations_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        # unless it finished first: 200 tokens of a tiny model can be quick
        generated = _metric(sharded.url, "turbospark_generated_tokens_total")
        assert _metric(sharded.url, "turbospark_cancellations_total") == 1 or generated >= 200
        # the server still answers, the same way
        assert _answers(sharded.url)[:2] == expected[:2]
        # a rank that dies ends the run: the stream in flight ends with a 503 error event, a
        # non-zero status, no hang
        rest = _cut_mid_stream(sharded.url, lambda: os.kill(sharded.follower_pid(), signal.SIGKILL))
        assert '"code":"rank_lost"' in rest.replace(" ", ""), (rest, "".join(sharded.lines[-30:]))
        assert sharded.proc.wait(timeout=60) != 0
        # noticed by a heartbeat's end (rank 1's, or another's that the loss of rank 1 ended), or
        # by a collective of rank 0's failing first
        lost = [line for line in sharded.lines if "a rank of the sharded model is lost" in line]
        assert lost and re.search(r"\((rank \d+ exited|a collective failed: \[ring\].*)\)", lost[0]), lost
        time.sleep(0.5)  # the last lines read
        assert "Traceback" not in "".join(sharded.lines), "".join(sharded.lines)  # one line a rank
    finally:
        sharded.stop()


def _cut_mid_stream(url: str, cut) -> str:  # type: ignore[no-untyped-def]
    """What a long stream says after ``cut`` is done to a rank, once it has begun."""
    body = {"model": "any", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
            "temperature": 0, "stream": True,
            "logit_bias": {"0": -100, "1": -100, "2": -100}}  # the tiny vocabulary's specials: no early end
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as s:
        lines = s.iter_lines()
        next(lines)
        cut()
        return "\n".join(lines)


def test_a_rank_that_cannot_be_reached_is_answered_503_and_ends_the_run(env, tmp_path: Path) -> None:
    """A stopped rank leaves its connections open and silent (as a cut-off host would): rank 0
    notices the missing heartbeats, answers the stream in flight and new requests with a
    retryable 503 and exits non-zero, where its collective would have waited for ever."""
    from turbospark.cli.lifeline import LOST_AFTER

    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model)
    sharded = _serve(env, model, 2)
    follower = sharded.follower_pid()
    try:
        began = time.monotonic()
        rest = _cut_mid_stream(sharded.url, lambda: os.kill(follower, signal.SIGSTOP))
        assert '"code":"rank_lost"' in rest.replace(" ", ""), rest
        assert time.monotonic() - began < LOST_AFTER + 30  # noticed, not waited on for ever
        r = httpx.post(f"{sharded.url}/v1/chat/completions", timeout=10,
                       json={"model": "any", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "rank_lost"
        assert r.headers["connection"] == "close" and r.headers["retry-after"]
        # rank 0 exits with status 1 (mlx.launch's SIGTERM waits on the stopped rank meanwhile)
        deadline = time.monotonic() + 30
        while not any("rank 0 exited with code 1" in line for line in sharded.lines):
            assert time.monotonic() < deadline, "".join(sharded.lines[-20:])
            time.sleep(0.1)
        assert any("sent no heartbeat" in line for line in sharded.lines)
        os.kill(follower, signal.SIGKILL)
        assert sharded.proc.wait(timeout=60) != 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already when the test got that far
            os.kill(follower, signal.SIGKILL)
        sharded.stop()


def _processes(marker: str) -> list[str]:
    """The processes whose command line names ``marker`` (a zombie's is empty), one
    ``pid: command line`` each."""
    if not Path("/proc/self/cmdline").exists():  # macOS
        out = subprocess.run(["ps", "-axww", "-o", "pid=,command="], capture_output=True, text=True).stdout
        return [line.strip() for line in out.splitlines() if marker in line]
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if marker in line:
            found.append(f"{path.parent.name}: {line}")
    return found


def _kill_all(marker: str) -> None:
    """What a failed test left running: killed, so that it holds no port or core."""
    for line in _processes(marker):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0].rstrip(":")), signal.SIGKILL)


# The script as a supervisor starts it: with SIGINT's default action even where this test runs
# with SIGINT ignored (started by `&` in a non-interactive shell), which bash could not trap.
DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


def _serve_script(env: dict[str, str], model: Path) -> Running:
    flags = ["--model", str(model), "--port", str(_port()), *NO_EXTRAS]
    script = str(ROOT / "scripts" / "serve-distributed")
    return Running([sys.executable, "-c", DEFAULT_SIGINT, script, "2", *flags], env)


def _port_free(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        if s.connect_ex((host, int(port))) == 0:
            return False
    with socket.socket() as s:  # as the server binds it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_script_stops_every_rank(env, tmp_path: Path, signum: int) -> None:
    """SIGTERM or SIGINT to the script's own pid (a supervisor's stop, not to its process group):
    rank 0 shuts down gracefully (the stream in flight ends whole) and ends the other rank; the
    script exits 128 + the signal's number once every process it started has ended, and leaves
    none behind, nor the port taken."""
    model = tmp_path / "tiny-llama.gguf"  # in this test's own folder: it names its processes
    write_tiny_gguf(model)
    sharded = _serve_script(env, model)
    try:
        sharded.follower_pid()  # both ranks hold their shards
        running = _processes(str(model))
        assert len(running) >= 3, running  # mlx.launch and 2 ranks
        body = {"model": "any", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 24,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{sharded.url}/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            next(lines)
            os.kill(sharded.proc.pid, signum)
            rest = "\n".join(lines)
        assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest, rest
        assert sharded.proc.wait(timeout=30) == 128 + signum
        assert _processes(str(model)) == [], "".join(sharded.lines[-20:])
        assert _port_free(sharded.url)
        assert sharded.said("turbospark: SIGINT, shutting down", count=1), "".join(sharded.lines)  # rank 0, gracefully
        said = "".join(sharded.lines)
        assert "exited with code" not in said and "Traceback" not in said, said  # no rank failed
    finally:
        sharded.stop()
        _kill_all(str(model))


def test_ranks_that_do_not_stop_are_killed_after_the_bound(env, tmp_path: Path) -> None:
    """A rank that cannot stop (a stopped process: rank 0's shutdown waits on it): the script kills
    what is left of its ranks SERVE_DISTRIBUTED_STOP_TIMEOUT seconds after the signal."""
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model)
    sharded = _serve_script({**env, "SERVE_DISTRIBUTED_STOP_TIMEOUT": "3"}, model)
    try:
        os.kill(sharded.follower_pid(), signal.SIGSTOP)
        began = time.monotonic()
        os.kill(sharded.proc.pid, signal.SIGTERM)
        assert sharded.proc.wait(timeout=30) == 143
        took = time.monotonic() - began
        assert _processes(str(model)) == [], "".join(sharded.lines[-20:])
        assert _port_free(sharded.url)
        assert 2 <= took < 20, took  # 3 s, counted in whole seconds
        assert sharded.said("did not stop within 3s", count=1), "".join(sharded.lines)
    finally:
        sharded.stop()
        _kill_all(str(model))


@pytest.mark.parametrize(("shard", "refusal"), [
    ("tensor", "do not split evenly over 3 ranks"),  # its heads, 4 and 2
    ("pipeline", "has 1 layers, fewer than the 3 ranks"),
])
def test_a_model_that_does_not_split_is_refused_on_every_rank(env, tmp_path: Path, shard: str, refusal: str) -> None:
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "serve-distributed"), "3", "--model", str(model), "--port", "0", "--shard", shard,
         *NO_EXTRAS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.count(refusal) == 3, proc.stderr  # one clear line on each rank
    assert "Traceback" not in proc.stderr, proc.stderr
