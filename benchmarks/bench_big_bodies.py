"""24 MiB request bodies of every shape beside one paced stream: how much do they stretch its gaps?

One server child (``serve --model M``; the scripted model paced by ``--token-delay-ms``) runs one
long streaming chat completion, each SSE chunk's arrival timed here.  Meanwhile another process
posts 24 MiB chat bodies to the same server, one shape at a time, ``--runs`` of each, a quiet
second before each:

- ``string``: one user message of one string, about 12 million words (refused: longer than the
  context window);
- ``messages``: 24,000 messages of 1 KiB each, users and assistants in turn (refused: more than
  4,096 messages);
- ``history``: 4,095 messages, every other one an assistant's 12 KiB, the users' short
  (refused: longer than the context window);
- ``parts``: one user message of 24,000 text parts of 1 KiB each (refused alike);
- ``tools``: a short message and 128 tools, each described in 190 KiB (refused alike);
- ``image``: a short text and a 24 MiB base64 image data URL (a text model: the image dropped
  with a note, answered);
- ``slow``: the ``string`` body sent at about 8 MiB/s (its Content-Length declared first);
- ``over``: a body whose Content-Length declares one byte over the 25 MiB limit, sent whole.

Reported per shape (medians over the runs): the stream's longest gap between two tokens while the
body was sent and answered (and 150 ms after), over its longest gap in the quiet second before
(the bar is 1.5x), and what the body was answered with and how long that took.

    python benchmarks/bench_big_bodies.py [--model scripted] [--token-delay-ms 50] [--runs 3]
                                          [--shapes string,messages,parts,image,slow,over]
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
from typing import Any
from urllib.parse import urlsplit

import httpx

from _server import Child

BODY = 24 * 1024 * 1024
SHAPES = ("string", "messages", "history", "parts", "tools", "image", "slow", "over")
QUIET = 1.0  # seconds of quiet before each body: the baseline
AFTER = 0.15  # a stall shows in the gap that ends after it: look this far past the answer


def body_of(shape: str, model: str) -> bytes:
    """A chat body of about ``BODY`` bytes in ``shape``."""
    base: dict[str, Any] = {"model": model, "max_tokens": 5}
    if shape in ("string", "slow"):
        base["messages"] = [{"role": "user", "content": "w " * (BODY // 2 - 64)}]
    elif shape == "messages":
        text = "word " * 200
        base["messages"] = [{"role": ("user", "assistant")[i % 2], "content": text} for i in range(BODY // 1048)]
    elif shape == "history":
        text = "word " * 2450
        base["messages"] = [{"role": "user", "content": "Go on."}] + [
            {"role": ("assistant", "user")[i % 2], "content": text if i % 2 == 0 else "Go on."} for i in range(4094)
        ]
    elif shape == "tools":
        tool = {"type": "function", "function": {"name": "look", "description": "word " * (BODY // 640),
                                                 "parameters": {"type": "object", "properties": {}}}}
        base["messages"] = [{"role": "user", "content": "Look it up."}]
        base["tools"] = [{**tool, "function": {**tool["function"], "name": f"look_{i}"}} for i in range(128)]
    elif shape == "parts":
        part = {"type": "text", "text": "word " * 200}
        base["messages"] = [{"role": "user", "content": [part] * (BODY // 1048)}]
    elif shape == "image":
        base["messages"] = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (BODY - 400)}},
        ]}]
    elif shape == "over":
        return b" " * (25 * 1024 * 1024 + 1)
    return json.dumps(base).encode()


def send_slowly(url: str, body: bytes, rate: float) -> int:
    """POST ``body`` over a raw socket at ``rate`` bytes a second; the answer's status."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        piece, start = 1 << 16, time.monotonic()
        for at in range(0, len(body), piece):
            s.sendall(body[at : at + piece])
            time.sleep(max(0.0, start + (at + piece) / rate - time.monotonic()))
        head = s.recv(65536).split(b" ", 2)
        return int(head[1])


def child_sender(url: str, shape: str, model: str, runs: int) -> None:
    """Build the body, then post it ``runs`` times, a quiet second before each; one JSON line a
    post: when it was sent and answered (``time.monotonic``, shared by every process here)."""
    body = body_of(shape, model)
    print("ready", flush=True)
    with httpx.Client(timeout=300) as client:
        for _ in range(runs):
            time.sleep(QUIET)
            start = time.monotonic()
            if shape == "slow":
                status, text = send_slowly(url, body, 8 * 1024 * 1024), ""
            else:
                r = client.post(f"{url}/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"})
                status, text = r.status_code, r.text[:160]
            print(json.dumps({"start": start, "end": time.monotonic(), "status": status, "said": text}), flush=True)


def stream(url: str, model: str, stamps: list[float], stop: threading.Event) -> None:
    body = {
        "model": model, "max_tokens": 8000, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    }
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.monotonic())
            if stop.is_set():
                return


def longest_gap(stamps: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive stamps that ends within [start, end], in ms."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if start <= b <= end]
    return max(gaps) * 1000 if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--token-delay-ms", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_sender(args.child[0], args.child[1], args.model, int(args.child[2]))

    serve_args = ["--model", args.model, "--stt-model", "none", "--tts-model", "none", "--embedding-model", "none"]
    if args.model == "scripted":
        serve_args += ["--token-delay-ms", str(args.token_delay_ms)]
    server = Child(serve_args)
    stamps: list[float] = []
    stop = threading.Event()
    reader = threading.Thread(target=stream, args=(server.url, args.model, stamps, stop), daemon=True)
    rows = []
    try:
        reader.start()
        deadline = time.monotonic() + 60
        while len(stamps) < 10:
            if time.monotonic() > deadline or not reader.is_alive():
                raise SystemExit("the stream did not start")
            time.sleep(0.05)
        for shape in args.shapes.split(","):
            sender = subprocess.Popen(
                [sys.executable, __file__, "--model", args.model, "--child", server.url, shape, str(args.runs)],
                stdout=subprocess.PIPE, text=True,
            )
            assert sender.stdout is not None
            assert sender.stdout.readline().strip() == "ready"
            posts = [json.loads(line) for line in sender.stdout]
            sender.wait()
            quiet = [longest_gap(stamps, p["start"] - QUIET + 0.1, p["start"]) for p in posts]
            during = [longest_gap(stamps, p["start"], p["end"] + AFTER) for p in posts]
            ratios = [d / q for d, q in zip(during, quiet)]
            rows.append({
                "shape": shape,
                "quiet_longest_gap_ms": round(statistics.median(quiet), 1),
                "during_longest_gap_ms": round(statistics.median(during), 1),
                "ratio": round(statistics.median(ratios), 2),
                "worst_ratio": round(max(ratios), 2),
                "answered_s": round(statistics.median(p["end"] - p["start"] for p in posts), 2),
                "statuses": sorted({p["status"] for p in posts}),
                "said": posts[-1]["said"],
            })
    finally:
        stop.set()
        server.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"model {args.model}, {args.token_delay_ms} ms a token, 24 MiB bodies, {args.runs} runs (medians)")
    print("| body | quiet: longest gap ms | during: longest gap ms | during / quiet (worst) | answered in s | status |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['quiet_longest_gap_ms']} | {r['during_longest_gap_ms']} | "
              f"{r['ratio']}x ({r['worst_ratio']}x) | {r['answered_s']} | {', '.join(map(str, r['statuses']))} |")
    for r in rows:
        print(f"{r['shape']}: {r['said']}")


if __name__ == "__main__":
    main()
