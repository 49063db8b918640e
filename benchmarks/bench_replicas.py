"""Replicas behind HAProxy (``scripts/deploy-local``), on the real default model.

1. Aggregate decode tok/s of ``--streams`` concurrent streams through the balancer with 1, 2 and 3
   replicas (each replica serves the chat model alone: no embedding or audio models).
2. Multi-turn conversations (``--conversations`` of ``--turns`` turns each, all at once) with
   and without the affinity rule: the share of prompt tokens read from the prefix cache.

On one host the replicas share its cores: with 2 cores, more replicas cannot decode faster in
total, and this measures what the balancer costs and keeps rather than scale-out.

    python -m turbospark.cli.blas python benchmarks/bench_replicas.py [--streams 16] [--max-tokens 32]
        [--replicas 1 2 3] [--conversations 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
SERVE = ["--model", "smollm2-135m-instruct", "--embedding-model", "none", "--stt-model", "none",
         "--tts-model", "none"]


def _base() -> int:
    while True:
        base = random.randrange(20000, 40000)
        try:
            for p in range(base, base + 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


class Deployment:
    def __init__(self, replicas: int, *flags: str) -> None:
        base = _base()
        self.url = f"http://127.0.0.1:{base}"
        cmd = [sys.executable, str(ROOT / "scripts" / "deploy_local.py"), "--port", str(base),
               "--first-replica-port", str(base + 1), "--replicas", str(replicas), *flags, *SERVE]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("turbospark listening on") and "(haproxy" in line:
                break
        else:
            raise SystemExit(f"deploy-local ended: {self.proc.wait()}")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


async def throughput(url: str, streams: int, max_tokens: int) -> float:
    tokens = 0

    async def one(i: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens
        body = {"model": "any", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Story {i}: tell me about the sea."}]}
        r = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"t{i}"})
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await one(-1, client)  # warm-up
        tokens = 0
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i, client)
        return tokens / (time.perf_counter() - t0)


async def cached_share(url: str, conversations: int, turns: int) -> float:
    prompt = cached = 0

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        nonlocal prompt, cached
        messages = [{"role": "system", "content": f"Conversation {c}. You are a patient tutor. " * 6}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn}: why is the sky blue?"})
            body = {"model": "any", "max_tokens": 12, "temperature": 0, "messages": messages}
            r = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"c{c}"})
            r.raise_for_status()
            out = r.json()
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
            if turn:
                prompt += out["usage"]["prompt_tokens"]
                cached += (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    async with httpx.AsyncClient(timeout=600) as client:
        async with trio.open_nursery() as nursery:
            for c in range(conversations):
                nursery.start_soon(conversation, c, client)
    return cached / max(prompt, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    print(f"| replicas | {args.streams} streams, aggregate tok/s |")
    print("| --- | --- |")
    for n in args.replicas:
        d = Deployment(n)
        try:
            rate = trio.run(throughput, d.url, args.streams, args.max_tokens)
        finally:
            d.stop()
        print(f"| {n} | {rate:.1f} |", flush=True)
    print(f"\n| affinity | cached share of prompt tokens, turns 2-{args.turns} |")
    print("| --- | --- |")
    for label, flags in (("on", ()), ("off", ("--no-affinity",))):
        d = Deployment(2, *flags)
        try:
            share = trio.run(cached_share, d.url, args.conversations, args.turns)
        finally:
            d.stop()
        print(f"| {label} | {share:.2f} |", flush=True)


if __name__ == "__main__":
    main()
