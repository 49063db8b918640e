"""Slow, idle and large clients beside a running stream: does anything they do stall it?

One server child (``serve --model M``; the scripted model paced by ``--token-delay-ms``).  For
each run, the same streaming chat completion (``--max-tokens`` new tokens, one SSE chunk per
token) is timed three ways, in turn:

1. alone;
2. while 25 MiB bodies arrive back to back from another process (alternately a chat with a
   25 MiB image, parsed and answered, and a chat with 25 MiB of text, refused as longer than the
   context window without being encoded in full);
3. while ``--idle`` connections are open and idle and ``--trickle`` more send a request head a
   byte every 50 ms (held by another process, opened before the stream starts).

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


def child_bodies(url: str, model: str) -> None:
    """Post 25 MiB bodies back to back until stdin closes; print the statuses."""
    bodies = big_bodies(model)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    statuses: Counter[str] = Counter()
    with httpx.Client(timeout=120) as client:
        print("ready", flush=True)
        i = 0
        while not stop.is_set():
            r = client.post(f"{url}/v1/chat/completions", content=bodies[i % 2],
                            headers={"content-type": "application/json"})
            statuses[f"{['image', 'text'][i % 2]} {r.status_code}"] += 1
            i += 1
    print(json.dumps(statuses), flush=True)


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
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, url = args.child[:2]
        return child_bodies(url, args.model) if kind == "bodies" else child_idle(url, args.idle, args.trickle)

    serve_args = ["--model", args.model, "--stt-model", "none", "--tts-model", "none"]
    if args.model == "scripted":
        serve_args += ["--token-delay-ms", str(args.token_delay_ms)]
    server = Child(serve_args)
    me = [sys.executable, __file__, "--model", args.model, "--idle", str(args.idle), "--trickle", str(args.trickle)]
    phases: dict[str, list[dict[str, float]]] = {"alone": [], "25 MiB bodies": [], "idle connections": []}
    loads: dict[str, list[Any]] = {"25 MiB bodies": [], "idle connections": []}
    try:
        with httpx.Client(timeout=600) as client:
            stream(client, server.url, args.model, 10, -1, "warm-up")
            for run in range(args.runs):
                phases["alone"].append(stream(client, server.url, args.model, args.max_tokens, run, "alone"))
                for phase, kind in (("25 MiB bodies", "bodies"), ("idle connections", "idle")):
                    result, report = with_load(
                        [*me, "--child", kind, server.url],
                        lambda phase=phase: stream(client, server.url, args.model, args.max_tokens, run, phase),
                    )
                    phases[phase].append(result)
                    loads[phase].append(report)
    finally:
        server.close()

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


if __name__ == "__main__":
    main()
