"""A soak: many mixed requests, a third of them abandoned, and the server must end clean.

One server child (``serve --model M --max-batch 4``, so most of 16 clients wait in the queue;
the scripted model paced by ``--token-delay-ms``).  ``--clients`` clients send ``--requests``
requests between them, each drawn at random from every route family the server has: OpenAI chat
completions, completions and responses (streaming and not), embeddings; Anthropic messages
(streaming and not) and count_tokens; Ollama embed, and /api/chat and /api/generate when the
server has them; a transcription (``/v1/audio/transcriptions``, half a second of tone) and a
realtime session (the WebSocket: three frames and a commit, answered ``complete``) on
``--stt-model`` (``scripted-stt`` beside the scripted model, else the server's default).  ``--disconnect`` of them (30 %) are abandoned by their client, aimed evenly at
the three phases of a generation: queued (closed a few ms after sending), prefill (a long prompt,
unlike any other, closed 0.05-0.8 s after sending) and decode (closed after a few tokens of a stream, or part way
through a plain one); the server's own count of what it stopped, by phase, comes from /metrics.
Every request is bounded (``--request-timeout``) and so is the whole soak (``--time-limit``).
With ``--faults P``, the server fails that share of its decode steps and prefill chunks on
purpose (``TURBOSPARK_FAULTS``): a request that met one is counted ``faulted`` (a 500 or an error
event with an error id), and every other must still be whole.

The first ``--warmup`` requests (the same mix) warm the server; then resident memory is read,
again at the half and at the end.  At the end the soak waits (at most 30 s) for the server to
report nothing in flight (``turbospark_generations_in_flight``), nothing queued
(``turbospark_queue_depth``) and empty batches (``turbospark_batch_size``).  Reported: requests by
kind (completed / abandoned / failed), the phases, the gauges, RSS growth, wall time.

    python benchmarks/bench_soak.py [--model scripted] [--requests 1000] [--clients 16]
                                    [--disconnect 0.3] [--faults 0.01] [--token-delay-ms 2]
                                    [--stt-model M] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import re
import struct
import statistics
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import trio

from _server import Child

PHASES = ("queued", "prefill", "decode")
LONG = " ".join(f"Paragraph {i}: the lighthouse keeper counted the ships passing in the night." for i in range(250))


class Kind:
    """One kind of request: how to build it, and how to tell that its answer is whole."""

    def __init__(self, name: str, path: str, stream: bool, generates: bool = True) -> None:
        self.name, self.path, self.stream, self.generates = name, path, stream, generates

    def body(self, model: str, embedder: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        family = self.name.split()[0]
        msgs = [{"role": "user", "content": prompt}]
        if family == "chat":
            return {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": self.stream}
        if family == "completions":
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": self.stream}
        if family == "responses":
            return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": self.stream}
        if family == "messages":
            return {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": self.stream}
        if family == "count_tokens":
            return {"model": model, "messages": msgs}
        if family == "embeddings":
            return {"model": embedder, "input": [prompt[:200], "a second input"]}
        if family == "embed":
            return {"model": embedder, "input": prompt[:200]}
        if family == "transcription":
            return {}  # a multipart form, built by the caller
        if family in ("ollama-chat", "ollama-generate"):
            key = {"messages": msgs} if family == "ollama-chat" else {"prompt": prompt}
            return {"model": model, **key, "stream": self.stream, "options": {"num_predict": max_tokens}}
        raise AssertionError(self.name)

    def whole(self, status: int, text: str) -> bool:
        if status != 200:
            return False
        family = self.name.split()[0]
        if family == "transcription":
            return "text" in json.loads(text)
        if self.stream:
            if family in ("chat", "completions"):
                return text.rstrip().endswith("data: [DONE]")
            if family == "responses":
                return "event: response.completed" in text
            if family == "messages":
                return "event: message_stop" in text
            return json.loads(text.strip().splitlines()[-1]).get("done") is True  # NDJSON
        body = json.loads(text)
        key = {"chat": "choices", "completions": "choices", "responses": "output", "messages": "content",
               "count_tokens": "input_tokens", "embeddings": "data", "embed": "embeddings",
               "ollama-chat": "message", "ollama-generate": "response"}[family]
        return key in body


def _wav(seconds: float = 0.5) -> bytes:
    """A tone as a 16 kHz mono WAV."""
    samples = [int(3000 * math.sin(2 * math.pi * 440 * i / 16000)) for i in range(int(seconds * 16000))]
    data = struct.pack(f"<{len(samples)}h", *samples)
    out = io.BytesIO()
    out.write(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt ")
    out.write(struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16) + b"data" + struct.pack("<I", len(data)) + data)
    return out.getvalue()


WAV = _wav()
FRAME = struct.pack("<1600h", *([1000] * 1600))  # 0.1 s of PCM for the realtime socket


def kinds(url: str) -> list[Kind]:
    out = [
        Kind("chat stream", "/v1/chat/completions", True), Kind("chat", "/v1/chat/completions", False),
        Kind("completions stream", "/v1/completions", True), Kind("completions", "/v1/completions", False),
        Kind("responses stream", "/v1/responses", True), Kind("responses", "/v1/responses", False),
        Kind("messages stream", "/v1/messages", True), Kind("messages", "/v1/messages", False),
        Kind("count_tokens", "/v1/messages/count_tokens", False, generates=False),
        Kind("embeddings", "/v1/embeddings", False, generates=False),
        Kind("embed", "/api/embed", False, generates=False),
    ]
    for name, path in (("ollama-chat", "/api/chat"), ("ollama-generate", "/api/generate")):
        if httpx.post(url + path, json={}, timeout=30).status_code != 404:  # the route exists
            out += [Kind(f"{name} stream", path, True), Kind(name, path, False)]
    out += [Kind("transcription", "/v1/audio/transcriptions", False, generates=False),
            Kind("realtime", "/v1/audio/transcriptions/realtime", True, generates=False)]
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, server: Child, model: str, embedder: str, stt: str) -> None:
        self.args, self.server, self.model, self.embedder, self.stt = args, server, model, embedder, stt
        self.kinds = kinds(server.url)
        self.rng = random.Random(args.seed)
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.aimed: Counter[str] = Counter()
        self.failures: list[str] = []
        self.latencies: list[float] = []

    async def realtime(self, cut: str | None) -> tuple[int, str]:
        """A session: three frames and a commit, then its ``complete``; cut: closed at once."""
        from trio_websocket import open_websocket_url

        url = self.server.url.replace("http://", "ws://") + f"/v1/audio/transcriptions/realtime?model={self.stt}"
        async with open_websocket_url(url) as ws:
            for _ in range(3):
                await ws.send_message(FRAME)
            await ws.send_message(json.dumps({"type": "commit"}))
            if cut is not None:
                return 200, ""
            message = json.loads(await ws.get_message())
        return (200 if message.get("type") == "complete" else 500), json.dumps(message)

    async def one(self, client: httpx.AsyncClient, kind: Kind, cut: str | None) -> None:
        rng, args = self.rng, self.args
        if kind.name == "realtime":
            with trio.move_on_after(args.request_timeout) as scope:
                status, text = await self.realtime(cut)
            if cut is not None:
                self.counts[kind.name]["abandoned"] += 1
            elif not scope.cancelled_caught and status == 200:
                self.counts[kind.name]["completed"] += 1
            else:
                self.counts[kind.name]["failed"] += 1
                self.failures.append(f"realtime: {'no answer' if scope.cancelled_caught else text[:200]}")
            return
        prompt = f"Tell me about ship {rng.randrange(10**6)}."
        if cut == "prefill":  # long, and unlike any other, so the prefix cache cannot shorten it
            prompt += " " + LONG
        body = kind.body(self.model, self.embedder, prompt, rng.randint(8, args.max_tokens))
        # the disconnect: a cancel scope around the request (httpx closes the connection)
        if cut is None:
            delay = args.request_timeout
        elif cut == "queued" or not kind.generates:
            delay = rng.uniform(0.0, 0.01)
        elif cut == "prefill":
            delay = rng.uniform(0.05, 0.8)
        else:  # decode: a stream is cut after a few events, a plain request part way through
            delay = rng.uniform(0.05, 0.5) if not kind.stream else args.request_timeout
        tokens_before_cut = rng.randint(1, 6) if cut == "decode" and kind.stream else None
        began = time.perf_counter()
        status, text = 0, ""
        sent: dict[str, Any] = {"json": body}
        if kind.name == "transcription":
            sent = {"files": {"file": ("tone.wav", WAV, "audio/wav")}, "data": {"model": self.stt}}
        with trio.move_on_after(delay) as scope:
            async with client.stream("POST", self.server.url + kind.path, **sent) as r:
                status = r.status_code
                chunks = []
                async for chunk in r.aiter_text():
                    chunks.append(chunk)
                    if tokens_before_cut is not None and sum(c.count("\n\n") for c in chunks) > tokens_before_cut:
                        break  # leaving the block closes the connection mid-stream
                text = "".join(chunks)
            if tokens_before_cut is not None:
                scope.cancel()
        if cut is not None:
            outcome = "abandoned" if scope.cancelled_caught or tokens_before_cut is not None else "finished first"
            self.counts[kind.name][outcome] += 1
            if status >= 500 and not (args.faults and re.search(r"error id [0-9a-f]{12}", text)):
                self.failures.append(f"{kind.name}: {status} {text[:200]}")
            return
        if scope.cancelled_caught:
            self.counts[kind.name]["timed out"] += 1
            self.failures.append(f"{kind.name}: no answer in {args.request_timeout} s")
        elif args.faults and re.search(r"error id [0-9a-f]{12}", text) \
                and not kind.whole(status, text):
            self.counts[kind.name]["faulted"] += 1  # met an injected fault: its own 500 or error event
        elif kind.whole(status, text):
            self.counts[kind.name]["completed"] += 1
            self.latencies.append(time.perf_counter() - began)
        else:
            self.counts[kind.name]["failed"] += 1
            self.failures.append(f"{kind.name}: {status} {text[:200]}")

    async def run(self, total: int) -> float:
        todo = iter(range(total))
        began = time.perf_counter()

        async def client_loop(client: httpx.AsyncClient) -> None:
            for _ in todo:
                kind = self.rng.choice(self.kinds)
                cut = self.rng.choice(PHASES) if self.rng.random() < self.args.disconnect else None
                if cut is not None:
                    self.aimed[cut if kind.generates else "before the answer"] += 1
                await self.one(client, kind, cut)

        limits = httpx.Limits(max_connections=self.args.clients * 2, max_keepalive_connections=self.args.clients)
        async with httpx.AsyncClient(timeout=self.args.request_timeout, limits=limits) as client:
            with trio.move_on_after(self.args.time_limit):
                async with trio.open_nursery() as nursery:
                    for _ in range(self.args.clients):
                        nursery.start_soon(client_loop, client)
        return time.perf_counter() - began


def settle(server: Child, limit: float = 30.0) -> tuple[dict[str, float], float]:
    names = ("turbospark_generations_in_flight", "turbospark_queue_depth", "turbospark_batch_size")
    began = time.perf_counter()
    while True:
        gauges = {name: server.gauge(name) for name in names}
        if not any(gauges.values()) or time.perf_counter() - began > limit:
            return gauges, time.perf_counter() - began
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=None, help="default: a tenth of --requests")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--token-delay-ms", type=int, default=2)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--time-limit", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=float, default=0.0, help="share of decode steps and prefill chunks failed on purpose")
    parser.add_argument("--stt-model", help="default: scripted-stt beside the scripted model, else the server's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warmup = args.requests // 10 if args.warmup is None else args.warmup

    stt = args.stt_model or ("scripted-stt" if args.model == "scripted" else None)
    serve_args = ["--model", args.model, "--max-batch", str(args.max_batch), "--max-queue", "64",
                  *(["--stt-model", stt] if stt else []), "--tts-model", "none"]
    if args.model == "scripted":
        serve_args += ["--token-delay-ms", str(args.token_delay_ms)]
    if args.faults:
        os.environ["TURBOSPARK_FAULTS"] = f"decode step:{100 * args.faults:g}%,prefill chunk:{100 * args.faults:g}%"
    server = Child(serve_args)
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        embedder = next((m["id"] for m in models if "embed" in json.dumps(m).lower() or "minilm" in m["id"]), "any")
        audio = httpx.get(server.url + "/v1/audio/models", timeout=30).json().get("data", [])
        stt = stt or next((m["id"] for m in audio if "speech_to_text" in json.dumps(m) or "whisper" in m["id"]), "any")
        soak = Soak(args, server, args.model, embedder, stt)
        trio.run(soak.run, warmup)
        settle(server)
        rss = {"after warm-up": server.rss_mb()}
        soak.counts.clear(), soak.aimed.clear(), soak.failures.clear(), soak.latencies.clear()
        base = server.metrics()
        half = args.requests // 2
        wall = trio.run(soak.run, half)
        rss["half-way"] = server.rss_mb()
        wall += trio.run(soak.run, args.requests - half)
        gauges, drained = settle(server)
        rss["end"] = server.rss_mb()
        end = server.metrics()
    finally:
        code = server.close()
    stopped = {
        phase: end.get(f'turbospark_cancellations_total{{phase="{phase}"}}', 0)
        - base.get(f'turbospark_cancellations_total{{phase="{phase}"}}', 0)
        for phase in PHASES
    }
    sent = sum(sum(c.values()) for c in soak.counts.values())
    report = {
        "model": args.model, "requests": sent, "clients": args.clients, "wall_s": round(wall, 1),
        "requests_per_s": round(sent / wall, 1),
        "median_latency_s": round(statistics.median(soak.latencies), 3) if soak.latencies else None,
        "kinds": {k: dict(v) for k, v in sorted(soak.counts.items())},
        "abandoned_aimed_at": dict(soak.aimed), "server_stopped_by_phase": stopped,
        "gauges_at_end": gauges, "drained_s": round(drained, 2),
        "rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "rss_growth_mb": round(rss["end"] - rss["after warm-up"], 1),
        "rss_growth_pct": round(100 * (rss["end"] / rss["after warm-up"] - 1), 2),
        "failures": soak.failures[:20], "failure_count": len(soak.failures), "exit_code": code,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"soak: {args.model}, {sent} requests after {warmup} warm-up, {args.clients} clients, "
          f"{args.disconnect:.0%} abandoned, {wall:.1f} s ({report['requests_per_s']} requests/s)")
    print("| kind | completed | abandoned | finished before the cut | faulted | failed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, c in sorted(soak.counts.items()):
        print(f"| {name} | {c['completed']} | {c['abandoned']} | {c['finished first']} | {c['faulted']} "
              f"| {c['failed'] + c['timed out']} |")
    print("abandoned, aimed at:", dict(soak.aimed))
    print("the server stopped, by phase:", stopped)
    print("at the end:", gauges, f"(settled in {drained:.2f} s)")
    print("RSS MB:", report["rss_mb"], f"growth {report['rss_growth_mb']} MB ({report['rss_growth_pct']} %)")
    print("failures:", len(soak.failures), *soak.failures[:20], sep="\n  ")
    print("server exit code:", code)


if __name__ == "__main__":
    main()
