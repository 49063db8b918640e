"""``deploy/haproxy.cfg`` driven for real: HAProxy (Debian's) in front of scripted replicas, started
by ``scripts/deploy-local`` as a user would.  Affinity keeps a conversation on the replica that
caches it; a replica killed mid-load fails only its own requests and is taken out within the
health checks' interval (HAProxy's stats page says so); a replica drained by SIGTERM fails none."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from ._support import chat_body, sse_events

ROOT = Path(__file__).resolve().parents[1]
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (scripts/setup --deploy)")


def _free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports."""
    while True:
        base = random.randrange(20000, 40000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


class Deployment:
    def __init__(self, *flags: str) -> None:
        base = _free_ports(4)
        self.url = f"http://127.0.0.1:{base}"
        self.stats = f"http://127.0.0.1:{base + 3}/stats;csv"
        cmd = [sys.executable, str(ROOT / "scripts" / "deploy_local.py"), "--port", str(base),
               "--first-replica-port", str(base + 1), "--stats-port", str(base + 3), *flags,
               "--model", "scripted", "--token-delay-ms", "20"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.pids: dict[str, int] = {}
        assert self.proc.stderr is not None
        said: list[str] = []
        for line in self.proc.stderr:
            said.append(line)
            if m := re.match(r"\s+(replica\d+): pid (\d+)", line):
                self.pids[m[1]] = int(m[2])
                if len(self.pids) == 2:
                    break
        else:
            raise AssertionError(f"deploy-local ended: {self.proc.wait()}; it said:\n{''.join(said[-30:])}")
        # keep reading its output, so the pipe never fills
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def deployment() -> Iterator[type[Deployment]]:
    made: list[Deployment] = []

    def make(*flags: str) -> Deployment:
        made.append(d := Deployment(*flags))
        return d

    yield make  # type: ignore[misc]
    for d in made:
        d.stop()


async def _turns(client: httpx.AsyncClient, url: str, session: str, header: str, turns: int = 3) -> list[tuple[str, int]]:
    """A conversation of ``turns`` turns: (replica, cached tokens) of each."""
    messages = [{"role": "system", "content": f"You help with session {session}. " * 8}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more."})
        r = await client.post(f"{url}/v1/chat/completions", headers={header: session} if header else {},
                              json={"model": "scripted", "messages": messages, "max_tokens": 8})
        assert r.status_code == 200, r.text
        body = r.json()
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        details = body["usage"].get("prompt_tokens_details") or {}
        out.append((r.headers["x-turbospark-replica"], details.get("cached_tokens", 0)))
    return out


async def test_affinity_keeps_each_conversation_on_the_replica_that_caches_it(deployment) -> None:
    d = deployment()
    async with httpx.AsyncClient(timeout=60) as client:
        for i, header in enumerate(["x-session-id", "x-claude-code-session-id"] * 3):
            turns = await _turns(client, d.url, f"s{i}", header)
            assert len({replica for replica, _ in turns}) == 1, turns
            assert all(cached > 0 for _, cached in turns[1:]), turns


async def test_without_affinity_turns_spread_and_miss_the_cache(deployment) -> None:
    d = deployment("--no-affinity")
    async with httpx.AsyncClient(timeout=60) as client:
        conversations = [await _turns(client, d.url, f"s{i}", "x-session-id") for i in range(4)]
    turns = [t for c in conversations for t in c]
    assert {replica for replica, _ in turns} == {"replica1", "replica2"}
    # a later turn that reached a replica new to its conversation read at most the few opening
    # tokens every conversation shares (with affinity every later turn reads its whole history)
    moved = [cached for c in conversations for i, (replica, cached) in enumerate(c)
             if i and replica not in {r for r, _ in c[:i]}]
    back = [cached for c in conversations for i, (replica, cached) in enumerate(c)
            if i and replica in {r for r, _ in c[:i]}]
    assert moved and max(moved) < 16, conversations
    assert all(cached > 40 for cached in back), conversations


async def test_the_openai_sdk_and_claude_codes_session_header_go_through_the_balancer(deployment) -> None:
    import openai

    d = deployment()
    sdk = openai.AsyncOpenAI(base_url=f"{d.url}/v1", api_key="unused",
                             default_headers={"X-Claude-Code-Session-Id": "a-claude-code-session"})
    replicas = set()
    for _ in range(3):
        raw = await sdk.chat.completions.with_raw_response.create(
            model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        done = raw.parse()
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
        replicas.add(raw.headers["x-turbospark-replica"])
        stream = await sdk.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert "".join(pieces) == done.choices[0].message.content
    assert len(replicas) == 1  # one session, one replica


async def _stream(client: httpx.AsyncClient, url: str, session: str, tokens: int, seen: dict) -> None:
    body = chat_body(max_tokens=tokens, stream=True)
    text = ""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"x-session-id": session}) as r:
            seen[session] = {"replica": r.headers.get("x-turbospark-replica"), "status": r.status_code, "done": False}
            async for chunk in r.aiter_text():
                text += chunk
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass
    seen[session]["done"] = bool(sse_events(text)) and sse_events(text)[-1][1] == "[DONE]"


async def _servers(client: httpx.AsyncClient, stats: str) -> dict[str, str]:
    """Each replica's status as HAProxy's stats page has it (``UP``, ``DOWN``, ``UP 1/2`` …)."""
    rows = (await client.get(stats)).text.splitlines()
    header = rows[0].lstrip("# ").split(",")
    at_name, at_status = header.index("svname"), header.index("status")
    return {cells[at_name]: cells[at_status] for row in rows[1:] if (cells := row.split(","))[0] == "replicas"
            and cells[at_name].startswith("replica")}


def _check_timing() -> tuple[float, int]:
    """``inter`` (seconds) and ``fall`` of the replicas' health checks in deploy/haproxy.cfg."""
    text = (ROOT / "deploy" / "haproxy.cfg").read_text()
    found = re.search(r"default-server inter (\d+)s fall (\d+)", text)
    assert found is not None
    return float(found[1]), int(found[2])


async def test_a_killed_replica_fails_only_its_own_requests(deployment) -> None:
    d = deployment()
    seen: dict[str, dict] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(_stream, client, d.url, f"k{i}", 150, seen)
            with trio.fail_after(30):
                while len(seen) < 6:
                    await trio.sleep(0.05)
            victims = {s for s, v in seen.items() if v["replica"] == "replica1"}
            assert victims and len(victims) < 6, seen
            assert (await _servers(client, d.stats))["replica1"] == "UP"
            os.kill(d.pids["replica1"], signal.SIGKILL)
            # the balancer takes it out within its health checks: `fall` failed checks `inter` apart
            inter, fall = _check_timing()
            with trio.fail_after(fall * inter + inter + 3):  # the checks' phase, and a loaded machine
                while (await _servers(client, d.stats))["replica1"].split()[0] != "DOWN":
                    await trio.sleep(0.1)
        for session, v in seen.items():
            assert v["done"] == (session not in victims), (session, v)
        # the balancer stops sending to it: every new request is answered, by replica2
        for i in range(10):
            r = await client.post(f"{d.url}/v1/chat/completions", json=chat_body(max_tokens=2),
                                  headers={"x-session-id": f"after{i}"})
            assert r.status_code == 200 and r.headers["x-turbospark-replica"] == "replica2"


async def test_a_replica_drained_by_sigterm_fails_no_request(deployment) -> None:
    d = deployment()
    results: list[tuple[int, bool, str | None]] = []
    stopped = trio.Event()

    async def client_loop(n: int, client: httpx.AsyncClient) -> None:
        i = 0
        while not stopped.is_set():
            text = ""
            async with client.stream("POST", f"{d.url}/v1/chat/completions",
                                     json=chat_body(max_tokens=20, stream=True),
                                     headers={"x-session-id": f"c{n}-{i}"}) as r:
                async for chunk in r.aiter_text():
                    text += chunk
                frames = sse_events(text)
                results.append((r.status_code, bool(frames) and frames[-1][1] == "[DONE]",
                                r.headers.get("x-turbospark-replica")))
            i += 1

    async with httpx.AsyncClient(timeout=60) as client:
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(client_loop, n, client)
            with trio.fail_after(30):
                while {r for _, _, r in results} != {"replica1", "replica2"}:
                    await trio.sleep(0.05)
            os.kill(d.pids["replica1"], signal.SIGTERM)
            await trio.sleep(5)  # the drain delay, the health checks, the grace
            before = len(results)
            await trio.sleep(2)
            stopped.set()
    failed = [r for r in results if not (r[0] == 200 and r[1])]
    assert results and not failed, failed
    assert {r for _, _, r in results[before:]} == {"replica2"}
