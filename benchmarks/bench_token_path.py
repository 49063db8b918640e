"""Where the server's time goes, a token and a step at a time: each thread's CPU while N streams
decode through HTTP, beside the engine alone.

1. The server (``serve``, the default model, ``--max-batch 16``): N streaming chat completions at
   once, greedy, ``ignore_eos``, ``--max-tokens`` new tokens each, read by a light client (raw
   sockets and one ``select`` loop in this process: no HTTP library, no JSON parsed while the
   streams run, so the client takes little of the cores the server needs).  Each of the
   server's threads' CPU time (``/proc/PID/task/*/stat``) over the run, divided by the tokens
   and by the decode steps (a step gives each of the N streams a token):

   - ``trio``: the event loop's thread (the routes: the step's crossing on the Trio side, the
     turn's events, SSE framing, Quart, Hypercorn, h11 and the socket writes);
   - ``model``: the model's Python thread (it builds each step's graph, waits for it, turns its
     tokens into text and parts, and crosses into Trio once a step);
   - ``kernels``: the threads that evaluate the step (MLX's stream thread and the kernels'
     team);
   - ``client``: this process (the light client).
2. The engine alone (``MlxBackend`` in a child process, no server): the same prompts (the chat
   template's ids), inserted together, stepped until each has its tokens, the same threads'
   CPU (``model`` is the thread that steps it).

Runs alternate size by size; reported: medians over ``--runs`` of tok/s (new tokens over wall
time, from the requests sent to the last token, prefill included), server/engine, and each
thread's CPU in microseconds a token (and a step).  What the server adds is the difference:
``trio`` whole, and ``model``'s and ``kernels``' excess over the engine's.

    python benchmarks/bench_token_path.py [--sizes 1,8,16] [--max-tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _server import Child
from bench_batch import conversation  # the same prompts as bench_batch's (distinct topics)

MODEL = "smollm2-135m-instruct"
TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name and CPU seconds so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (stat[stat.index("(") + 1: stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK)
    return out


def split(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
          model_tid: int) -> dict[str, float]:
    """CPU seconds by role: the model's Python thread, the main thread (Trio's, in the server),
    the threads the model's thread started (MLX's stream thread, the kernels' team: they carry
    its name), the rest."""
    out = {"trio": 0.0, "model": 0.0, "kernels": 0.0, "other": 0.0}
    model_name = after[model_tid][0]
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        role = ("model" if tid == model_tid else "trio" if tid == pid
                else "kernels" if name == model_name and tid > model_tid else "other")
        out[role] += used
    return out


def light_streams(url: str, n: int, max_tokens: int, tag: str) -> tuple[float, float, int]:
    """N streaming chat completions at once over raw sockets; (wall seconds, seconds until every
    stream had a token, content pieces)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sel = selectors.DefaultSelector()
    got: dict[int, list[bytes]] = {}
    t0 = time.perf_counter()
    for i in range(n):
        body = json.dumps({"model": MODEL, "messages": conversation(tag, i), "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)
        got[i] = []
    left, waiting, first = n, set(range(n)), 0.0
    while left:
        for key, _ in sel.select():
            data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
            if data:
                got[key.data].append(data)
                if key.data in waiting and data.count(b'"content":"') > data.count(b'"content":""'):
                    waiting.discard(key.data)
                    first = time.perf_counter() - t0
                continue
            sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
            left -= 1
    wall = time.perf_counter() - t0
    pieces = 0
    for parts in got.values():
        raw = b"".join(parts)
        assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces += bool(choice["delta"].get("content"))
    return wall, first, pieces


def engine_child(max_tokens: int) -> None:
    """Child: the engine alone; answers each JSON line ``{size, tag}`` on stdin."""
    from turbospark.cli.blas import describe
    from turbospark.model.backend import SamplingParams
    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore, store_root

    stored = pull(MODEL, ModelStore(store_root()), progress=False)
    backend = MlxBackend(stored.path, model_id=MODEL)
    print(json.dumps({"blas": describe()}), flush=True)
    pid = os.getpid()
    me = threading.get_native_id()
    for line in sys.stdin:
        job = json.loads(line)
        n = job["size"]
        prompts = [backend.tokenizer.encode_chat(conversation(job["tag"], i)) for i in range(n)]
        before = threads(pid)
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            backend.insert(i, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        got = dict.fromkeys(range(n), 0)
        first = 0.0
        while any(v < max_tokens for v in got.values()):
            if not first and all(got.values()):
                first = time.perf_counter() - t0
            out = backend.step()
            for seq in out.tokens:
                got[seq] += len(out.emitted(seq))
                if got[seq] >= max_tokens:
                    backend.remove(seq)
        wall = time.perf_counter() - t0
        cpu = split(pid, before, threads(pid), me)
        print(json.dumps({"wall_s": wall, "first_s": first, "tokens": sum(got.values()), "cpu": cpu}), flush=True)


def model_thread(pid: int) -> int:
    """The server's model thread: the first thread named after the model."""
    return min(tid for tid, (name, _) in threads(pid).items() if name.startswith("model:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        from turbospark.cli.blas import reexec_with_openblas

        reexec_with_openblas([sys.executable, *sys.argv])  # as serve does (a no-op once done)
        engine_child(args.max_tokens)
        return
    engine = subprocess.Popen([sys.executable, __file__, "--child", "--max-tokens",
                               str(args.max_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert engine.stdin is not None and engine.stdout is not None
    blas = json.loads(engine.stdout.readline())["blas"]
    server = Child(["--model", MODEL, "--max-batch", "16"])
    pid = server.proc.pid
    results: dict[int, dict[str, list[Any]]] = {n: {"server": [], "engine": []} for n in sizes}
    try:
        light_streams(server.url, 8, 16, "warm-up")
        mid = model_thread(pid)
        for run in range(args.runs + 1):  # run 0 warms both up
            for n in sizes:
                engine.stdin.write(json.dumps({"size": n, "tag": f"Run {run}, {n} streams, engine"}) + "\n")
                engine.stdin.flush()
                eng = json.loads(engine.stdout.readline())
                before, mine = threads(pid), os.times()
                wall, first, pieces = light_streams(server.url, n, args.max_tokens, f"Run {run}, {n} streams, server")
                after, mine2 = threads(pid), os.times()
                cpu = split(pid, before, after, mid)
                cpu["client"] = mine2.user + mine2.system - mine.user - mine.system
                if run:
                    assert pieces >= n * args.max_tokens // 2, f"{pieces} content pieces for {n} x {args.max_tokens}"
                    results[n]["server"].append({"wall_s": wall, "first_s": first, "tokens": n * args.max_tokens,
                                                 "cpu": cpu})
                    results[n]["engine"].append(eng)
    finally:
        server.close()
        engine.stdin.close()
        engine.wait()
    print(f"model {MODEL}, {args.runs} runs (medians), {args.max_tokens} new tokens a stream, greedy, ignore_eos; "
          f"BLAS: {blas}")
    print("CPU in microseconds a token (a step: times the streams) by thread: trio / model / kernels / client")
    print(f"{'streams':>7}  {'engine tok/s':>12}  {'server tok/s':>12}  {'server/engine':>13}  "
          f"{'engine CPU us/token':>24}  {'server CPU us/token':>30}")
    for n in sizes:
        row = {}
        for path in ("engine", "server"):
            samples = results[n][path]
            row[path] = (statistics.median(s["tokens"] / s["wall_s"] for s in samples),
                         {k: statistics.median(s["cpu"].get(k, 0.0) / s["tokens"] * 1e6 for s in samples)
                          for k in ("trio", "model", "kernels", "client")})
        e, s = row["engine"], row["server"]
        print(f"{n:>7}  {e[0]:>12.1f}  {s[0]:>12.1f}  {s[0] / e[0]:>13.3f}  "
              f"{'- / %.0f / %.0f / -' % (e[1]['model'], e[1]['kernels']):>24}  "
              f"{'%.0f / %.0f / %.0f / %.0f' % tuple(s[1][k] for k in ('trio', 'model', 'kernels', 'client')):>30}")
    print("The two phases: until every stream has its first token, and after (its tok/s), engine / server")
    print(f"{'streams':>7}  {'every first token s':>20}  {'tok/s after':>16}  {'server/engine after':>19}")
    for n in sizes:
        phases = {}
        for path in ("engine", "server"):
            samples = results[n][path]
            phases[path] = (statistics.median(x["first_s"] for x in samples),
                            statistics.median((x["tokens"] - n) / (x["wall_s"] - x["first_s"]) for x in samples))
        (ef, ea), (sf, sa) = phases["engine"], phases["server"]
        print(f"{n:>7}  {'%.3f / %.3f' % (ef, sf):>20}  {'%.1f / %.1f' % (ea, sa):>16}  {sa / ea:>19.3f}")


if __name__ == "__main__":
    main()
