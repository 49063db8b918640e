"""One model sharded over 2 ranks (``scripts/serve-distributed 2``) against 1 process, by layers
and by tensors, and how long a lost rank takes to be answered.

Two models: the default one (SmolLM2-135M-Instruct as it is served, 4-bit; its 9 heads do not
split over 2 ranks, so by layers only), and a random-weight Llama of ``--hidden`` width,
``--layers`` layers and 16 heads (8 key/value) with SmolLM2's tokenizer, which splits both ways
(what it says is meaningless, the work per step is real).  Per setup: greedy decode of
``--max-tokens`` tokens through the HTTP API, several runs, the median step time (decode time /
tokens), whether the texts agree with one process's, and the bytes rank 1 sends per step (its
TCP sockets' count, from ``ss``, over the runs: the ring's, and the heartbeat's byte a second).  Then, on
the default model by layers, the time from a rank's death (SIGKILL) and from its stop (SIGSTOP:
no heartbeat) to the 503 ``rank_lost`` event on the stream in flight.

    python benchmarks/bench_distributed.py [--hidden 1024] [--layers 12] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_distributed import Running, _port  # noqa: E402


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tests.realmodels import smollm2_native_store

    source = smollm2_native_store().path
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": hidden * 3, "num_attention_heads": 16, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-5, "vocab_size": vocab, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.apply(lambda p: p * 0.05 if p.ndim > 1 else p)  # keep activations in range
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    del nn
    return out


def start(model: str, ranks: int, shard: str | None, env: dict[str, str]) -> Running:
    """``serve`` (1 rank) or ``scripts/serve-distributed`` with ``shard``, listening."""
    flags = ["--model", model, "--port", str(_port()), "--embedding-model", "none",
             "--stt-model", "none", "--tts-model", "none"]
    cmd = ([str(ROOT / "scripts" / "serve-distributed"), str(ranks), "--shard", str(shard)] if ranks > 1
           else [sys.executable, "-m", "turbospark", "serve"]) + flags
    return Running(cmd, env)


def written(pid: int | None) -> int:
    """Bytes ``pid``'s TCP sockets have sent so far (``ss``: the ring's, and the heartbeat's)."""
    if pid is None:
        return 0
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        elif mine and (m := re.search(r"bytes_sent:(\d+)", line)):
            total += int(m[1])
    return total


def decode(url: str, max_tokens: int) -> tuple[float, str]:
    body = {"model": "any", "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count to a hundred."}]}
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        first = None
        text = ""
        tokens = 0
        with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        delta = choice["delta"].get("content") or ""
                        if delta and first is None:
                            first = time.perf_counter()
                        text += delta
        end = time.perf_counter()
    if tokens < max_tokens // 2:
        raise SystemExit(f"the model stopped after {tokens} tokens: too few to time")
    return (end - (first or t0)) / max(tokens - 1, 1), text


def lost_after(url: str, cut, streams: int = 4) -> tuple[list[float], str, float]:  # type: ignore[no-untyped-def]
    """Seconds from ``cut`` (done to rank 1 while ``streams`` streams decode) to each stream's
    ``rank_lost`` event; what a new request sent then gets, and when."""
    body = {"model": "any", "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count to a thousand."}]}
    started = threading.Barrier(streams + 1)
    began: list[float] = []
    answered: list[float] = []

    def one() -> None:
        with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait()
            for line in lines:
                if "rank_lost" in line:
                    answered.append(time.perf_counter() - began[0])
                    return

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for thread in threads:
        thread.start()
    started.wait()
    began.append(time.perf_counter())
    cut()
    for thread in threads:
        thread.join()
    if len(answered) < streams:
        raise SystemExit(f"{streams - len(answered)} streams ended without rank_lost")
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        new = str(r.status_code)
    except httpx.ConnectError:
        new = "refused (rank 0 has ended)"
    return sorted(answered), new, time.perf_counter() - began[0]


SETUPS = [("1 process", 1, None), ("2 ranks by layers", 2, "pipeline"), ("2 ranks by tensors", 2, "tensor")]


def measure(model: str, setups: list, args, env) -> list[tuple[str, float, int, bool]]:  # type: ignore[no-untyped-def]
    """Per setup: its name, median step time, bytes rank 1 wrote per step, whether its texts
    are one process's."""
    rows = []
    reference: set[str] = set()
    for name, ranks, shard in setups:
        server = start(model, ranks, shard, env)
        try:
            decode(server.url, 4)  # warm-up
            pid = server.follower_pid() if ranks > 1 else None
            before, steps, texts = written(pid), [], set()
            for _ in range(args.runs):
                step, text = decode(server.url, args.max_tokens)
                steps.append(step)
                texts.add(text)
            sent = (written(pid) - before) // (args.runs * args.max_tokens)
        finally:
            server.stop()
        reference = reference or texts
        rows.append((name, statistics.median(steps), sent, texts == reference and len(texts) == 1))
    return rows


def table(rows: list[tuple[str, float, int, bool]]) -> None:
    print("| setup | step (ms) | tok/s | rank 1 sends a step | text as 1 process's |")
    print("| --- | --- | --- | --- | --- |")
    for name, step, sent, same in rows:
        print(f"| {name} | {step * 1e3:.1f} | {1 / step:.1f} | {f'{sent / 1024:.1f} KiB' if sent else '-'} | "
              f"{'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--faults-only", action="store_true", help="only the time from a lost rank to the 503s")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="turbospark-bench-dist-"))
    env = {**os.environ, "TURBOSPARK_HOME": str(work / "home"), "MLX_RING_PORT": str(random.randrange(30000, 40000))}
    try:
        from tests.realmodels import smollm2_native_store

        stored = smollm2_native_store().path  # the default model, as a fresh machine serves it
        shutil.copytree(stored, work / "home" / "models" / stored.name, copy_function=os.link)
        if not args.faults_only:
            print(f"greedy, {args.max_tokens} tokens, {args.runs} runs (medians)\n")
            print("SmolLM2-135M-Instruct (the default model, 4-bit):")
            table(measure("smollm2-135m-instruct", SETUPS[:2], args, env))
            model = make_model(work / "random-llama", args.hidden, args.layers)
            print(f"\nrandom Llama, hidden {args.hidden}, {args.layers} layers, 16 heads (float32):")
            table(measure(str(model), SETUPS, args, env))
        print("\nfrom a lost rank to the 503s (default model, by layers, 4 streams decoding):")
        for how, sig in (("killed", signal.SIGKILL), ("stopped", signal.SIGSTOP)):
            server = start("smollm2-135m-instruct", 2, "pipeline", env)
            pid = server.follower_pid()
            try:
                each, new, at = lost_after(server.url, lambda: os.kill(pid, sig))
                print(f"- rank 1 {how}: the streams' 503s after {each[0]:.2f} to {each[-1]:.2f} s; "
                      f"a new request then: {new} at {at:.2f} s")
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
