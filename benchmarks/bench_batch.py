"""Continuous batching side by side: the aggregate throughput of N concurrent streams through
turbospark against mlx-lm's own ``batch_generate``, and what a request joining a running batch
costs the streams already in it.

1. Throughput.  For each size N: N chat prompts ("Write a long, detailed story about <topic>.",
   a distinct topic per stream, behind a system line naming the run, the size and the stream, so
   neither the server's prefix cache nor an earlier run helps), greedy, ``--max-tokens`` new
   tokens each.  Raw: ``mlx_lm.generate.batch_generate`` on the same token ids (turbospark's
   tokenizer renders the chat template for both paths, and stops on the same end-of-turn ids),
   timed around the call.  Server: N streaming chat completions sent at once, timed from the first
   request sent to the last stream finished.  Both: new tokens actually generated / wall time,
   prefill included.  Reported per size (medians over ``--runs``): raw tok/s, server tok/s,
   server/raw (target >= 0.9) and the server's speed-up over its own 1-stream figure (target >= 3
   at 8 streams), with how many streams stopped short of ``--max-tokens`` (end of turn).
2. Joining a running batch.  8 long streams decode; once each has produced a few tokens a 9th
   request with a ~300-token prompt arrives.  Reported (medians over ``--runs``): its time to
   first token (beside the same kind of request on the idle server), and the stall it causes the
   8: the longest gap between consecutive tokens of any of them while the 9th prefills, against
   their median gap before it arrived.

    python benchmarks/bench_batch.py [--model smollm2-135m-instruct] [--sizes 1,2,4,8,16]
                                     [--max-tokens 64] [--runs 3] [--max-batch 16] [--json]

One server (``serve --max-batch``) serves every size and part 2; one child process runs mlx-lm,
with OpenBLAS preloaded where installed and turbospark's CPU kernels in its model
(``mlx_kernels.install``), as ``python -m turbospark serve`` does: both paths compute alike, and
server/raw is what the server adds.  Where llama-cpp-python is built
(``scripts/check-against-llama-cpp``), llama.cpp decodes the one-stream prompt on the same GGUF and
cores in every run too, measured the same way (new tokens over wall time, prefill included).  After a warm-up
round on both, raw and server runs alternate size by size, so whatever else the machine is doing
weighs on both alike.  Client-side figures: the streaming client shares the machine's cores with
the server (one SSE chunk per token with visible text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench_decode import ServerPath, stream_chat, summary

TOPICS = (
    "a lighthouse keeper", "a clockmaker's apprentice", "a desert caravan", "a deep-sea diver",
    "a mountain village", "a travelling circus", "a lost astronaut", "a haunted library",
    "a river pirate", "a dragon hatchling", "a detective in Venice", "a robot gardener",
    "an arctic expedition", "a jazz musician", "a volcano observatory", "a forgotten kingdom",
)
JOINING = 8  # streams already decoding when the new request of part 2 arrives
FEW = 6  # tokens each of them has produced before it arrives
JOIN_PROMPT_TOKENS = 300


def conversation(tag: str, stream: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"{tag}, stream {stream}. You are a helpful assistant."},
        {"role": "user", "content": f"Write a long, detailed story about {TOPICS[stream % len(TOPICS)]}."},
    ]


def batch(size: int, run: int) -> list[list[dict[str, str]]]:
    return [conversation(f"Run {run}, {size} streams", i) for i in range(size)]


# --- raw mlx-lm (child process) -------------------------------------------------------------


def run_raw(model_dir: Path) -> None:
    """Child: load once, then answer each JSON line ``{size, run, max_tokens}`` on stdin."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    from turbospark.cli.blas import describe
    from turbospark.model.mlx_ggml import load_model
    from turbospark.model.mlx_kernels import install
    from turbospark.model.tokenizer import Tokenizer

    model, _ = load_model(model_dir)
    mx.eval(model.parameters())
    kernels = install(model)  # the server's compute: the difference is the server's own
    tok = Tokenizer.from_dir(model_dir)  # the same prompt ids and stop ids the server uses
    wrapper = SimpleNamespace(eos_token_ids=sorted(tok.stop_ids), decode=tok.decode)
    print(json.dumps({"blas": describe(), "kernels": kernels}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        prompts = [tok.encode_chat(c) for c in batch(job["size"], job["run"])]
        t0 = time.perf_counter()
        out = batch_generate(model, wrapper, prompts, max_tokens=job["max_tokens"], return_token_ids=True)
        wall = time.perf_counter() - t0
        mx.clear_cache()
        print(json.dumps({"wall_s": wall, "tokens": [len(t) for t in out.token_ids], "texts": out.texts}), flush=True)


# --- the server (this process drives a child server) ----------------------------------------


class BatchServer(ServerPath):
    """bench_decode's server child, started with ``--max-batch``, and many streams at once."""

    def __init__(self, model: str, max_batch: int) -> None:
        super().__init__(model, max_tokens=0, serve_args=["--max-batch", str(max_batch)])
        assert self.proc.stderr is not None
        self.log: list[str] = []  # drained, so a chatty server never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def stream(self, messages: list[dict[str, str]], max_tokens: int, stamps: list[float]) -> dict[str, Any]:
        """One streaming chat completion; appends a time stamp per chunk with text to ``stamps``."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage, text = stream_chat(self.client, self.url, body, stamps)
        return {"end": time.perf_counter(), "tokens": usage["completion_tokens"], "text": text}


class Stream(threading.Thread):
    """One request on its own thread, sent when ``gate`` opens."""

    def __init__(self, server: BatchServer, messages: list[dict[str, str]], max_tokens: int,
                 gate: threading.Barrier) -> None:
        super().__init__(daemon=True)
        self.server, self.messages, self.max_tokens, self.gate = server, messages, max_tokens, gate
        self.stamps: list[float] = []
        self.sent = float("nan")
        self.result: dict[str, Any] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        self.gate.wait()
        self.sent = time.perf_counter()
        try:
            self.result = self.server.stream(self.messages, self.max_tokens, self.stamps)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc

    def finish(self) -> dict[str, Any]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


def start_all(server: BatchServer, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[Stream]:
    gate = threading.Barrier(len(conversations) + 1)
    streams = [Stream(server, c, max_tokens, gate) for c in conversations]
    for s in streams:
        s.start()
    gate.wait()
    return streams


def server_batch(server: BatchServer, size: int, run: int, max_tokens: int) -> dict[str, Any]:
    streams = start_all(server, batch(size, run), max_tokens)
    results = [s.finish() for s in streams]
    wall = max(r["end"] for r in results) - min(s.sent for s in streams)
    tokens = [r["tokens"] for r in results]
    return {"wall_s": wall, "tokens": tokens, "texts": [r["text"] for r in results]}


# --- part 2: a request joining a running batch ----------------------------------------------


def join_prompt(tok: Any, tag: str) -> list[dict[str, str]]:
    """A conversation of about ``JOIN_PROMPT_TOKENS`` prompt tokens."""
    notes = [f"{tag}. Summarise these notes in one sentence."]
    k = 0
    while len(tok.encode_chat([{"role": "user", "content": "\n".join(notes)}])) < JOIN_PROMPT_TOKENS:
        notes.append(f"Note {k}: {TOPICS[k % len(TOPICS)]} was recorded on day {k * 7 + 3}.")
        k += 1
    return [{"role": "user", "content": "\n".join(notes)}]


def join_run(server: BatchServer, tok: Any, run: int, long_tokens: int) -> dict[str, float]:
    idle: list[float] = []
    sent = time.perf_counter()
    server.stream(join_prompt(tok, f"Idle run {run}"), 4, idle)
    idle_ttft = idle[0] - sent

    streams = start_all(server, [conversation(f"Join run {run}", i) for i in range(JOINING)], long_tokens)
    while min(len(s.stamps) for s in streams) < FEW:
        if any(not s.is_alive() for s in streams):
            break
        time.sleep(0.002)
    all_started = max(s.stamps[0] for s in streams if s.stamps)
    ninth: list[float] = []
    sent = time.perf_counter()
    server.stream(join_prompt(tok, f"Join run {run}"), 4, ninth)
    first = ninth[0]
    for s in streams:
        s.finish()

    before, during, alive = [], [], 0
    for s in streams:
        gaps = list(zip(s.stamps, s.stamps[1:]))
        before += [b - a for a, b in gaps if a >= all_started and b <= sent]
        during += [b - a for a, b in gaps if b > sent and a < first]
        alive += s.stamps[-1] > first
    if alive < JOINING:
        print(f"join run {run}: only {alive}/{JOINING} streams outlived the new request's prefill; "
              f"raise --max-tokens", file=sys.stderr)
    return {
        "ttft_s": first - sent,
        "idle_ttft_s": idle_ttft,
        "gap_before_s": statistics.median(before) if before else float("nan"),
        "stall_s": max(during) if during else float("nan"),
    }


# --- driver ----------------------------------------------------------------------------------


def tps(sample: dict[str, Any]) -> float:
    return sum(sample["tokens"]) / sample["wall_s"]


def compare(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    raw = subprocess.Popen(
        [sys.executable, __file__, "--child", "--model", args.model],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert raw.stdin is not None and raw.stdout is not None
    first = json.loads(raw.stdout.readline())
    blas, kernels = first["blas"], first["kernels"]
    server = BatchServer(args.model, args.max_batch)
    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    llama = llama_cpp(args)
    llama_samples: list[float] = []

    def raw_batch(size: int, run: int, max_tokens: int) -> dict[str, Any]:
        raw.stdin.write(json.dumps({"size": size, "run": run, "max_tokens": max_tokens}) + "\n")
        raw.stdin.flush()
        return json.loads(raw.stdout.readline())

    samples: dict[int, dict[str, list[dict[str, Any]]]] = {n: {"raw": [], "server": []} for n in args.sizes}
    try:
        warm = max(args.sizes)  # run -1: warm-up, not counted
        raw_batch(warm, -1, min(8, args.max_tokens))
        server_batch(server, warm, -1, min(8, args.max_tokens))
        for run in range(args.runs):
            for size in args.sizes:
                samples[size]["raw"].append(raw_batch(size, run, args.max_tokens))
                samples[size]["server"].append(server_batch(server, size, run, args.max_tokens))
            if llama is not None:  # one stream, the 1-stream prompt of this run
                answer = llama.run(tok.encode_chat(batch(1, run)[0]), args.max_tokens)
                n, sample = len(answer["tokens"]), answer["sample"]
                llama_samples.append(n / (sample["ttft_s"] + (n - 1) / sample["decode_tps"]))
        raw.stdin.close()
        raw.wait(timeout=60)

        long_tokens = max(4 * args.max_tokens, 64)
        joins = [join_run(server, tok, run, long_tokens) for run in range(args.runs)]
    finally:
        server.close()
        if raw.poll() is None:
            raw.kill()
        if llama is not None:
            llama.close()

    sizes = {}
    for size, s in samples.items():
        raw_tps = statistics.median(tps(x) for x in s["raw"])
        server_tps = statistics.median(tps(x) for x in s["server"])
        sizes[size] = {
            "raw_tps": raw_tps,
            "server_tps": server_tps,
            "ratio": server_tps / raw_tps,
            "raw_tokens": [sum(x["tokens"]) for x in s["raw"]],
            "server_tokens": [sum(x["tokens"]) for x in s["server"]],
            "short_streams": sum(t < args.max_tokens for x in s["raw"] + s["server"] for t in x["tokens"]),
            "same_text": sum(a == b for r, v in zip(s["raw"], s["server"]) for a, b in zip(r["texts"], v["texts"]))
            / (size * args.runs),
        }
    if 1 in sizes:
        for figures in sizes.values():
            figures["speedup"] = figures["server_tps"] / sizes[1]["server_tps"]
    llama_tps = statistics.median(llama_samples) if llama_samples else None
    return {"blas": blas, "kernels": kernels, "sizes": sizes, "llama_cpp_tps": llama_tps,
            "join": summary(joins) | {"runs": joins}}


def llama_cpp(args: argparse.Namespace) -> Any:
    """bench_llama_cpp's llama.cpp child on the catalogue model's GGUF, or None (not built)."""
    import os

    from _gguf import catalogue_gguf
    from bench_llama_cpp import Child, llama_cpp_python

    python = llama_cpp_python()
    if python is None:
        print("llama.cpp: skipped, llama-cpp-python is not built (scripts/check-against-llama-cpp)", file=sys.stderr)
        return None
    threads = str(os.cpu_count() or 2)
    command = [str(python), str(Path(__file__).parent / "bench_llama_cpp.py"), "--threads", threads, "--child",
               "llama-cpp", "--path", str(catalogue_gguf(args.model)), "--prompt-tokens", "512",
               "--max-tokens", str(args.max_tokens)]  # fmt: skip
    return Child(command, dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads))


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    print(f"model {args.model}, {args.runs} runs (medians), {args.max_tokens} new tokens a stream, greedy, "
          f"server --max-batch {args.max_batch}; BLAS: {results['blas']}; {results['kernels']}")
    print(f"{'streams':>7} {'raw tok/s':>10} {'server tok/s':>13} {'server/raw':>11} {'vs 1 stream':>12} "
          f"{'tokens raw/server':>18} {'short':>6} {'same text':>10}")
    for size, f in results["sizes"].items():
        speedup = f"{f['speedup']:.2f}x" if "speedup" in f else "-"
        tokens = f"{statistics.median(f['raw_tokens']):.0f}/{statistics.median(f['server_tokens']):.0f}"
        print(f"{size:>7} {f['raw_tps']:>10.1f} {f['server_tps']:>13.1f} {f['ratio']:>11.3f} {speedup:>12} "
              f"{tokens:>18} {f['short_streams']:>6} {f['same_text']:>10.0%}")
    sizes = results["sizes"]
    if (llama := results["llama_cpp_tps"]) is not None:
        print(f"llama.cpp, one stream (same GGUF, cores and prompt as 1): {llama:.1f} tok/s; the server's streams "
              + ", ".join(f"{n}: {f['server_tps'] / llama:.2f}x" for n, f in sizes.items()))
    worst = min(sizes.values(), key=lambda f: f["ratio"])["ratio"]
    print(f"server/raw >= 0.9 at every size: {'yes' if worst >= 0.9 else 'NO'} (worst {worst:.3f})")
    if 8 in sizes and "speedup" in sizes[8]:
        print(f"8 streams >= 3x one stream: {'yes' if sizes[8]['speedup'] >= 3 else 'NO'} "
              f"({sizes[8]['speedup']:.2f}x)")
    j = results["join"]
    print(f"a ~{JOIN_PROMPT_TOKENS}-token request joining {JOINING} decoding streams: TTFT {j['ttft_s']:.3f} s "
          f"(idle server {j['idle_ttft_s']:.3f} s); their longest gap while it prefills {j['stall_s']:.3f} s "
          f"vs median gap before {j['gap_before_s']:.3f} s ({j['stall_s'] / j['gap_before_s']:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="concurrent streams, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = sorted({int(n) for n in args.sizes.split(",")})

    from turbospark.cli.attach import stored_model
    from turbospark.cli.blas import reexec_with_openblas

    if args.child:
        reexec_with_openblas([sys.executable, *sys.argv])
        run_raw(stored_model(args.model)[0])
        return

    model_dir, _ = stored_model(args.model)  # import or pull once, before anything is timed
    results = compare(args, model_dir)
    report(args, results)
    if args.json:
        print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "runs": args.runs,
                          "max_batch": args.max_batch} | results, indent=2))


if __name__ == "__main__":
    main()
