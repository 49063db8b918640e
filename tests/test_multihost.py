"""Ranks on separate hosts: a sharded model whose two ranks run in two network namespaces of the
test's own making, joined by a virtual link (veth), started the way docs/deployment.md says for
several hosts (``mlx.launch --hostfile``, which reaches each host by ``ssh``: here an ``ssh``
that enters the host's namespace).  Clients reach rank 0 over a second link, as they would over
the hosts' own network.  The greedy text equals one process's.

Needs root and iproute2 (``ip netns``); skipped, saying so, without them."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .model.tiny import write_tiny_gguf
from .test_distributed import LAUNCH, NO_EXTRAS, Running, _answers, _serve

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")

CLIENTS, RANK0_CLIENTS = "10.77.1.1", "10.77.1.2"  # the test (this namespace) and rank 0's host
RANK0, RANK1 = "10.77.0.1", "10.77.0.2"  # the ranks' own link

# An ssh for mlx.launch: ``ssh [-tt] [-o OPT] HOST SCRIPT`` runs SCRIPT in HOST's namespace.
FAKE_SSH = """#!/bin/bash
while [[ "$1" == -* ]]; do if [[ "$1" == -o ]]; then shift 2; else shift; fi; done
host=$1; shift
for pair in $NETNS_OF_HOSTS; do [[ ${pair%%=*} == "$host" ]] && ns=${pair#*=}; done
exec ip netns exec "${ns:?no host $host}" /bin/bash -c "$*"
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces, ``a`` (rank 0) and ``b`` (rank 1): a-b on the ranks' link, this
    namespace-a on the clients' link."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("separate hosts need root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"tsa{tag}", f"tsb{tag}"
    try:
        try:
            _ip("netns", "add", a)
            _ip("netns", "add", b)
            _ip("link", "add", f"c{tag}", "type", "veth", "peer", "name", f"ca{tag}", "netns", a)
            _ip("link", "add", f"r{tag}", "netns", a, "type", "veth", "peer", "name", f"rb{tag}", "netns", b)
            _ip("addr", "add", f"{CLIENTS}/24", "dev", f"c{tag}")
            _ip("link", "set", f"c{tag}", "up")
            for ns, link, address in ((a, f"ca{tag}", RANK0_CLIENTS), (a, f"r{tag}", RANK0), (b, f"rb{tag}", RANK1)):
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"hosts of the test's own cannot be made here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_ranks_on_separate_hosts_answer_as_one_process(hosts: tuple[str, str], tmp_path: Path) -> None:
    a, b = hosts
    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model, layers=3)
    env = {**os.environ, "TURBOSPARK_HOME": str(tmp_path / "home")}
    single = _serve(env, model, None)
    try:
        expected = _answers(single.url)
    finally:
        single.stop()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": RANK0, "ips": [RANK0]}, {"ssh": RANK1, "ips": [RANK1]}]}))
    env = {**env, "PATH": f"{bin_dir}:{env['PATH']}", "NETNS_OF_HOSTS": f"{RANK0}={a} {RANK1}={b}"}
    port = random.randrange(20000, 30000)
    sharded = Running(
        [str(LAUNCH), "--hostfile", str(hostfile), "--backend", "ring", "--starting-port", str(random.randrange(30000, 40000)),
         "--python", sys.executable, "--", "-m", "turbospark", "serve", "--distributed", "--shard", "pipeline",
         "--model", str(model), "--host", RANK0_CLIENTS, "--port", str(port), *NO_EXTRAS], env)
    try:
        follower = sharded.follower_pid()
        where = subprocess.run(["ip", "netns", "identify", str(follower)], capture_output=True, text=True).stdout
        assert where.strip() == b  # rank 1 runs on the other host
        assert sharded.url == f"http://{RANK0_CLIENTS}:{port}"
        assert _answers(sharded.url) == expected
    finally:
        sharded.stop()
