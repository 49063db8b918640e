"""HAProxy in front of N turbospark replicas on this host (``scripts/deploy-local``).

    scripts/deploy-local [--replicas N] [--port 11434] [--first-replica-port 11501]
                         [--stats-port PORT] [--no-affinity] [serve flags…]

Writes ``deploy/haproxy.cfg`` with this run's ports into a temporary directory (without the
``# affinity`` lines under ``--no-affinity``), starts N replicas (``python -m turbospark
serve --port P --drain-delay 3 --graceful-timeout 60 [serve flags…]``), waits until each is ready,
then starts HAProxy and prints ``turbospark listening on http://127.0.0.1:PORT``, a line per
replica (name, pid, address) and where HAProxy's stats page is (``--stats-port``, by default the
balancer's port + 1).  SIGINT or SIGTERM drains the replicas (SIGTERM to each) and then
stops HAProxy.  HAProxy comes from Debian: ``scripts/setup --deploy`` installs it.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "haproxy.cfg"


def config(template: str, *, port: int, replicas: list[int], affinity: bool, stats_port: int | None = None) -> str:
    """The template with this run's frontend and stats ports and one server line per replica."""
    out: list[str] = []
    for line in template.splitlines():
        stripped = line.strip()
        if not affinity and stripped.endswith("# affinity"):
            continue
        if stripped.startswith("bind 127.0.0.1:"):
            stats = stripped.endswith("# stats")
            line = line.replace(stripped, f"bind 127.0.0.1:{(stats_port or port + 1) if stats else port}")
        if stripped.startswith("server replica"):
            if stripped.startswith("server replica1 "):
                indent = line[: len(line) - len(line.lstrip())]
                out += [f"{indent}server replica{i} 127.0.0.1:{p} check" for i, p in enumerate(replicas, 1)]
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _ready(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"deploy-local: {url} exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"deploy-local: {url} was not ready within {timeout:g} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="deploy-local", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=11434, help="the balancer's port (default 11434)")
    parser.add_argument("--first-replica-port", type=int, default=11501)
    parser.add_argument("--stats-port", type=int, help="HAProxy's stats page (default: the balancer's port + 1)")
    parser.add_argument("--no-affinity", action="store_true", help="leave out the conversation affinity rule")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args, serve_flags = parser.parse_known_args(argv)
    haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if haproxy is None:
        raise SystemExit("deploy-local: haproxy is not installed (scripts/setup --deploy installs it)")
    ports = [args.first_replica_port + i for i in range(args.replicas)]
    work = Path(tempfile.mkdtemp(prefix="turbospark-deploy-"))
    cfg = work / "haproxy.cfg"
    cfg.write_text(config(TEMPLATE.read_text(), port=args.port, replicas=ports, affinity=not args.no_affinity,
                          stats_port=args.stats_port))
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    replicas: list[subprocess.Popen] = []
    balancer: subprocess.Popen | None = None
    try:
        for port in ports:
            cmd = [sys.executable, "-m", "turbospark", "serve", "--port", str(port),
                   "--drain-delay", "3", "--graceful-timeout", "60", *serve_flags]
            replicas.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL))
        for port, proc in zip(ports, replicas):
            _ready(f"http://127.0.0.1:{port}", args.ready_timeout, proc)
        balancer = subprocess.Popen([haproxy, "-f", str(cfg), "-db"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL)
        _ready(f"http://127.0.0.1:{args.port}", 30, balancer)
        print(f"turbospark listening on http://127.0.0.1:{args.port} (haproxy, {len(ports)} replicas, "
              f"config {cfg})", file=sys.stderr, flush=True)
        for i, (port, proc) in enumerate(zip(ports, replicas), 1):
            print(f"  replica{i}: pid {proc.pid}, http://127.0.0.1:{port}", file=sys.stderr, flush=True)
        print(f"  stats: http://127.0.0.1:{args.stats_port or args.port + 1}/stats", file=sys.stderr, flush=True)
        while not stopping:
            if balancer.poll() is not None:
                raise SystemExit(f"deploy-local: haproxy exited with status {balancer.returncode}")
            time.sleep(0.2)
    finally:
        for proc in replicas:  # drain: each finishes what it runs
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in replicas:
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
        if balancer is not None and balancer.poll() is None:
            balancer.terminate()
            balancer.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
