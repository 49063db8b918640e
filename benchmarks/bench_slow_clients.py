"""Slow, idle and large clients beside a running stream: does anything they do stall it?

One server child (``serve --model M``; the scripted model paced by ``--token-delay-ms``).  For
each run, the same streaming chat completion (``--max-tokens`` new tokens, one SSE chunk per
token) is timed five ways, in turn:

1. alone;
2. while 25 MiB bodies arrive back to back from another process (alternately a chat with a
   25 MiB image, parsed and answered, and a chat with 25 MiB of text, refused as longer than the
   context window without being encoded in full);
3. the same bodies sent to another server process instead (a bare HTTP server that decodes
   them): what they cost the stream through the machine alone (the sender, the kernel, a
   decode on the same cores), which no server can avoid;
4. while ``--idle`` connections are open and idle and ``--trickle`` more send a request head a
   byte every 50 ms (held by another process, opened before the stream starts);
5. while another process asks for embeddings of ``--embed-inputs`` texts back to back (the
   server's default embedding model; each answer ~3 MB of JSON numbers at 2,048).

Reported per phase (medians over ``--runs``): the longest gap between two consecutive tokens of
the stream, its median gap, and the longest gap over the one alone; plus what the loads got
(bodies answered, with their statuses).

    python benchmarks/bench_slow_clients.py [--model scripted] [--token-delay-ms 10]
                                            [--max-tokens 150] [--runs 3] [--idle 300] [--trickle 20]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import httpx

from _server import Child

BODY = 25 * 1024 * 1024
#: the control phase: the same bodies sent to another process, not to this server
SINK = "25 MiB bodies to another process"


def big_bodies(model: str) -> list[bytes]:
    image = {
        "model": model, "max_tokens": 5,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (BODY - 400)}},
        ]}],
    }
    text = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "word " * (BODY // 5 - 40)}]}
    return [json.dumps(image).encode(), json.dumps(text).encode()]


def post_until_told(post: Any, timeout: float) -> None:
    """Child loop: ``post(client, i)`` (it returns a status label) back to back until stdin
    closes; then print the labels counted."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    statuses: Counter[str] = Counter()
    with httpx.Client(timeout=timeout) as client:
        print("ready", flush=True)
        i = 0
        while not stop.is_set():
            statuses[post(client, i)] += 1
            i += 1
    print(json.dumps(statuses), flush=True)


def child_bodies(url: str, model: str) -> None:
    """Post 25 MiB bodies back to back until stdin closes; print the statuses."""
    bodies = big_bodies(model)

    def post(client: httpx.Client, i: int) -> str:
        r = client.post(f"{url}/v1/chat/completions", content=bodies[i % 2],
                        headers={"content-type": "application/json"})
        return f"{['image', 'text'][i % 2]} {r.status_code}"

    post_until_told(post, 120)


def child_embeds(url: str, inputs: int) -> None:
    """Ask for embeddings of ``inputs`` short texts back to back until stdin closes (each answer
    is ``inputs`` x 384 numbers of JSON, ~3 MB at 2,048); print the statuses."""

    def post(client: httpx.Client, i: int) -> str:
        texts = [f"note {i}-{n}" for n in range(inputs)]  # new texts: no cache anywhere
        r = client.post(f"{url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": texts})
        return f"embeddings {r.status_code}"

    post_until_told(post, 300)


def child_sink() -> None:
    """A bare HTTP server in its own process that reads each body whole, decodes its JSON (what
    any server must do with it) and answers 400: what the bodies cost the machine without this
    server (the sender, the kernel, one decode)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


def child_idle(url: str, idle: int, trickle: int) -> None:
    """Hold ``idle`` open connections and ``trickle`` that send a head a byte every 50 ms."""
    parts = urlsplit(url)
    address = (parts.hostname, parts.port)
    conns = [socket.create_connection(address) for _ in range(idle)]
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: 10\r\n\r\n".encode()
    slow = [socket.create_connection(address) for _ in range(trickle)]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    sent, cut = 0, 0
    while not stop.is_set():
        for i, s in enumerate(slow):
            try:
                s.send(head[sent % len(head) : sent % len(head) + 1])
            except OSError:  # cut at the header timeout: open another
                cut += 1
                slow[i] = socket.create_connection(address)
        sent += 1
        time.sleep(0.05)
    print(json.dumps({"idle": len(conns), "trickling": trickle, "cut at the header timeout": cut}), flush=True)


def stream(client: httpx.Client, url: str, model: str, max_tokens: int, run: int, phase: str) -> dict[str, float]:
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "messages": [{"role": "system", "content": f"Run {run}, {phase}."},
                     {"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    }
    stamps: list[float] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"tokens": len(stamps), "max_gap_ms": max(gaps) * 1000, "median_gap_ms": statistics.median(gaps) * 1000}


def with_load(cmd: list[str], fn: Any) -> tuple[Any, Any]:
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # the load is on
    try:
        result = fn()
    finally:
        child.stdin.close()
    report = json.loads(child.stdout.readline())
    child.wait(timeout=120)
    return result, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--token-delay-ms", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--trickle", type=int, default=20)
    parser.add_argument("--embed-inputs", type=int, default=2048,
                        help="inputs per embeddings request in the embeddings phase (0: no such phase)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "sink":
            return child_sink()
        kind, url = args.child[:2]
        if kind == "embeds":
            return child_embeds(url, args.embed_inputs)
        return child_bodies(url, args.model) if kind == "bodies" else child_idle(url, args.idle, args.trickle)

    serve_args = ["--model", args.model, "--stt-model", "none", "--tts-model", "none",
                  "--embedding-model", "all-minilm-l6-v2" if args.embed_inputs else "none"]
    if args.model == "scripted":
        serve_args += ["--token-delay-ms", str(args.token_delay_ms)]
    server = Child(serve_args)
    me = [sys.executable, __file__, "--model", args.model, "--idle", str(args.idle), "--trickle", str(args.trickle),
          "--embed-inputs", str(args.embed_inputs)]
    embeds = f"{args.embed_inputs}-input embedding answers"
    sink = subprocess.Popen([*me, "--child", "sink"], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    sink_url = sink.stdout.readline().strip()
    plan = [("25 MiB bodies", "bodies", server.url), (SINK, "bodies", sink_url), ("idle connections", "idle", server.url)]
    if args.embed_inputs:
        plan.append((embeds, "embeds", server.url))
    phases: dict[str, list[dict[str, float]]] = {"alone": [], **{p[0]: [] for p in plan}}
    loads: dict[str, list[Any]] = {p[0]: [] for p in plan}
    try:
        with httpx.Client(timeout=600) as client:
            stream(client, server.url, args.model, 10, -1, "warm-up")
            for run in range(args.runs):
                phases["alone"].append(stream(client, server.url, args.model, args.max_tokens, run, "alone"))
                for phase, kind, url in plan:
                    result, report = with_load(
                        [*me, "--child", kind, url],
                        lambda phase=phase: stream(client, server.url, args.model, args.max_tokens, run, phase),
                    )
                    phases[phase].append(result)
                    loads[phase].append(report)
    finally:
        server.close()
        sink.kill()

    alone = statistics.median(r["max_gap_ms"] for r in phases["alone"])
    rows = []
    for phase, results in phases.items():
        longest = statistics.median(r["max_gap_ms"] for r in results)
        rows.append({
            "phase": phase,
            "tokens": min(r["tokens"] for r in results),
            "longest_gap_ms": round(longest, 1),
            "median_gap_ms": round(statistics.median(r["median_gap_ms"] for r in results), 2),
            "longest_vs_alone": round(longest / alone, 2),
        })
    if args.json:
        print(json.dumps({"rows": rows, "loads": loads}, indent=2))
        return
    print(f"model {args.model}, {args.max_tokens} tokens a stream, {args.runs} runs (medians)")
    print("| phase | longest token gap ms | median gap ms | longest / alone |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['phase']} | {row['longest_gap_ms']} | {row['median_gap_ms']} | {row['longest_vs_alone']} |")
    bodies: Counter[str] = Counter()
    for report in loads["25 MiB bodies"]:
        bodies.update(report)
    print("25 MiB bodies answered during the streams:", dict(bodies))
    print("connections held:", loads["idle connections"][-1])
    if args.embed_inputs:
        answered: Counter[str] = Counter()
        for report in loads[embeds]:
            answered.update(report)
        print("embedding answers during the streams:", dict(answered))


if __name__ == "__main__":
    main()
