"""One model sharded over 2 ranks (``scripts/serve-distributed 2``) against 1 process, same model.

No model on this machine splits evenly over 2 ranks (SmolLM2-135M has 9 heads, Gemma 3 270M one
key/value head), so the model is a random-weight Llama of ``--hidden`` width, ``--layers`` layers
and 16 heads (8 key/value), with SmolLM2's tokenizer: what it says is meaningless, the work per
step is real.  Per setup, alternating: greedy decode of ``--max-tokens`` tokens through the HTTP
API, several runs, the median step time (decode time / tokens), and whether the texts agree.
The difference between 2 ranks' step time and half of one process's is what splitting costs
(the all-sums between ranks and their lockstep), reported as its share of the step.

    python benchmarks/bench_distributed.py [--hidden 1024] [--layers 12] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
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


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tests.realmodels import smollm2_store

    source = smollm2_store().path
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, ranks: int, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    flags = ["--model", str(model), "--port", str(_port()), "--embedding-model", "none",
             "--stt-model", "none", "--tts-model", "none"]
    cmd = ([str(ROOT / "scripts" / "serve-distributed"), str(ranks)] if ranks > 1
           else [sys.executable, "-m", "turbospark", "serve"]) + flags
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("turbospark listening on "):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, line.split()[3]
    raise SystemExit(f"serve ended: {proc.wait()}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="turbospark-bench-dist-"))
    env = {**os.environ, "TURBOSPARK_HOME": str(work / "home"), "MLX_RING_PORT": str(random.randrange(30000, 40000))}
    try:
        model = make_model(work / "random-llama", args.hidden, args.layers)
        steps: dict[int, list[float]] = {1: [], 2: []}
        texts: dict[int, set[str]] = {1: set(), 2: set()}
        for ranks in (1, 2):
            proc, url = start(model, ranks, env)
            try:
                decode(url, 4)  # warm-up
                for _ in range(args.runs):
                    step, text = decode(url, args.max_tokens)
                    steps[ranks].append(step)
                    texts[ranks].add(text)
            finally:
                stop(proc)
        one, two = statistics.median(steps[1]), statistics.median(steps[2])
        print(f"random Llama, hidden {args.hidden}, {args.layers} layers, 16 heads; greedy, {args.max_tokens} "
              f"tokens, {args.runs} runs (medians)")
        print("| setup | step (ms) | tok/s |")
        print("| --- | --- | --- |")
        print(f"| 1 process | {one * 1e3:.1f} | {1 / one:.1f} |")
        print(f"| 2 ranks (ring, loopback) | {two * 1e3:.1f} | {1 / two:.1f} |")
        print(f"splitting's share of a 2-rank step (step - half of one process's): {max(0.0, two - one / 2) / two:.0%}")
        print(f"greedy text identical: {texts[1] == texts[2] and len(texts[1]) == 1}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
