"""Decode speed side by side: raw ``mlx_lm.stream_generate`` against turbospark's streaming
endpoint (and llama.cpp on the same GGUF when ``llama-cpp-python`` is importable).

The same chat prompt, greedy, the same number of new tokens, several runs each; every run starts
with a distinct system line so the server's prefix cache cannot help.  Reported per path (medians):
time to first token, prefill tok/s (prompt tokens / time to first token), decode tok/s
((new tokens - 1) / time from first to last token, as the client sees them) and peak RSS of the
process doing the work.  The headline figure is the server/raw decode ratio.

    python benchmarks/bench_decode.py [--model smollm2-135m-instruct] [--runs 5] [--max-tokens 64]
                                      [--gguf PATH]

Each path runs in its own process (so peak RSS is its own), with OpenBLAS preloaded where
installed, exactly as ``python -m turbospark serve`` does.  Raw and server runs alternate (after
one warm-up run each), so whatever else the machine is doing weighs on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _rss import peak_rss_mb  # the scripts' folder is on sys.path

PROMPT = (
    "Write a detailed, multi-paragraph story about a lighthouse keeper who discovers a message "
    "in a bottle, describing the sea, the weather and the keeper's daily routine."
)


def messages(run: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Run {run}. You are a helpful assistant."},
        {"role": "user", "content": PROMPT},
    ]


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def timing(t0: float, stamps: list[float], prompt_tokens: int) -> dict[str, float]:
    ttft = stamps[0] - t0
    return {
        "ttft_s": ttft,
        "prefill_tps": prompt_tokens / ttft,
        "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "new_tokens": len(stamps),
    }


# --- raw mlx-lm (child process) -------------------------------------------------------------


def run_raw(model_dir: Path, max_tokens: int) -> None:
    """Child: load once, then answer ``run N`` lines on stdin with one JSON line each."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from turbospark.cli.blas import describe
    from turbospark.model.tokenizer import Tokenizer

    model, hf_tokenizer = load(str(model_dir))
    tok = Tokenizer.from_dir(model_dir)  # the same prompt ids the server renders
    print(json.dumps({"blas": describe()}), flush=True)
    for line in sys.stdin:
        run = int(line.split()[1])
        ids = tok.encode_chat(messages(run))
        stamps, tokens = [], []
        t0 = time.perf_counter()
        for response in stream_generate(model, hf_tokenizer, ids, max_tokens=max_tokens):
            stamps.append(time.perf_counter())
            tokens.append(response.token)
        mx.clear_cache()
        sample = timing(t0, stamps, len(ids)) | {"prompt_tokens": len(ids)}
        peak_mb = peak_rss_mb()
        print(json.dumps({"sample": sample, "text": tok.decode(tokens), "peak_rss_mb": peak_mb}), flush=True)


# --- llama.cpp (child process) --------------------------------------------------------------


def run_llamacpp(gguf: Path, model_dir: Path, runs: int, max_tokens: int) -> dict[str, Any]:
    from llama_cpp import Llama

    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=os.cpu_count() or 2, verbose=False)
    samples = []
    for run in range(runs):
        ids = tok.encode_chat(messages(run))
        llm.reset()
        stamps = []
        t0 = time.perf_counter()
        for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            stamps.append(time.perf_counter())
            if n + 1 >= max_tokens:
                break
        samples.append(timing(t0, stamps, len(ids)) | {"prompt_tokens": len(ids)})
    peak_mb = peak_rss_mb()
    return {"summary": summary(samples) | {"peak_rss_mb": peak_mb}}


# --- the server (this process drives a child server) ----------------------------------------


def stream_chat(client: Any, url: str, body: dict[str, Any], stamps: list[float]) -> tuple[dict[str, Any], str]:
    """One streaming chat completion (``stream_options.include_usage`` set in ``body``): a time
    stamp per chunk with text goes to ``stamps``; returns the usage and the text.  The body is
    read as raw bytes while it streams (a stamp for each content piece a read holds) and parsed
    once it has ended, so the client spends little of the cores the server shares with it."""
    pieces: list[bytes] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for data in r.iter_raw():
            now = time.perf_counter()
            stamps += [now] * (data.count(b'"content":"') - data.count(b'"content":""'))
            pieces.append(data)
    parts, usage = [], None
    for line in b"".join(pieces).decode().splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if content := choice["delta"].get("content"):
                parts.append(content)
    assert usage is not None, "no usage chunk"
    return usage, "".join(parts)


class ServerPath:
    """A ``python -m turbospark serve`` child and a client streaming from it."""

    def __init__(self, model: str, max_tokens: int, serve_args: Sequence[str] = ()) -> None:
        import httpx

        self.model, self.max_tokens = model, max_tokens
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turbospark", "serve", "--model", model, "--port", "0", *serve_args],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if m := re.match(r"turbospark listening on (\S+)", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit("the server did not start")
        self.client = httpx.Client(timeout=600)

    def run(self, run: int) -> tuple[dict[str, float], str]:
        body = {
            "model": self.model,
            "messages": messages(run),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stamps: list[float] = []
        t0 = time.perf_counter()
        usage, text = stream_chat(self.client, self.url, body, stamps)
        # one SSE chunk per token with visible text; scale to the real token count
        sample = timing(t0, stamps, usage["prompt_tokens"])
        sample["decode_tps"] *= (usage["completion_tokens"] - 1) / max(len(stamps) - 1, 1)
        sample["new_tokens"] = usage["completion_tokens"]
        return sample | {"prompt_tokens": usage["prompt_tokens"]}, text

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.proc.pid)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


def child_command(kind: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, __file__, "--child", kind, "--runs", str(args.runs),
           "--max-tokens", str(args.max_tokens), "--model", args.model]
    return cmd + (["--gguf", str(args.gguf)] if args.gguf else [])


def compare_mlx(args: argparse.Namespace) -> dict[str, Any]:
    """Raw and server, one run each in turn (warm-up first), so load on the machine hits both."""
    raw = subprocess.Popen(child_command("raw", args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert raw.stdin is not None and raw.stdout is not None
    blas = json.loads(raw.stdout.readline())["blas"]
    server = ServerPath(args.model, args.max_tokens)
    raw_samples, server_samples, raw_texts, server_texts = [], [], [], []
    peak = 0.0
    try:
        for run in range(-1, args.runs):  # run -1 warms both up and is not counted
            raw.stdin.write(f"run {run}\n")
            raw.stdin.flush()
            result = json.loads(raw.stdout.readline())
            sample, text = server.run(run)
            if run >= 0:
                raw_samples.append(result["sample"])
                raw_texts.append(result["text"])
                peak = result["peak_rss_mb"]
                server_samples.append(sample)
                server_texts.append(text)
        server_peak = server.peak_rss_mb()
    finally:
        server.close()
        raw.stdin.close()
        raw.wait(timeout=30)
    return {
        "blas": blas,
        "raw mlx_lm": {"summary": summary(raw_samples) | {"peak_rss_mb": peak}, "texts": raw_texts},
        "turbospark": {"summary": summary(server_samples) | {"peak_rss_mb": server_peak}, "texts": server_texts},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gguf", type=Path, help="the GGUF for the llama.cpp comparison")
    parser.add_argument("--child", choices=["raw", "llamacpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    from turbospark.cli.attach import stored_model
    from turbospark.cli.blas import reexec_with_openblas

    if args.child:
        reexec_with_openblas([sys.executable, *sys.argv])
        model_dir, _ = stored_model(args.model)
        if args.child == "raw":
            run_raw(model_dir, args.max_tokens)
        else:
            print(json.dumps(run_llamacpp(args.gguf, model_dir, args.runs, args.max_tokens)))
        return

    stored_model(args.model)  # import or pull once, before anything is timed
    compared = compare_mlx(args)
    results = {name: compared[name] for name in ("raw mlx_lm", "turbospark")}
    try:
        import llama_cpp  # noqa: F401

        if args.gguf:
            out = subprocess.run(child_command("llamacpp", args), check=True, capture_output=True, text=True)
            results["llama.cpp"] = json.loads(out.stdout.splitlines()[-1])
        else:
            print("llama.cpp: importable, pass --gguf to compare it", file=sys.stderr)
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed, skipped", file=sys.stderr)

    raw, server = results["raw mlx_lm"], results["turbospark"]
    print(f"model {args.model}, {args.runs} runs, {args.max_tokens} new tokens, greedy; "
          f"BLAS: {compared['blas']}")
    print(f"{'path':<12} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MB':>12}")
    for name, result in results.items():
        s = result["summary"]
        print(f"{name:<12} {s['ttft_s']:>8.3f} {s['prefill_tps']:>14.1f} {s['decode_tps']:>13.2f} "
              f"{s['peak_rss_mb']:>12.0f}")
    ratio = server["summary"]["decode_tps"] / raw["summary"]["decode_tps"]
    print(f"server/raw decode ratio: {ratio:.3f}")
    print(f"same greedy text: {raw['texts'] == server['texts']}")


if __name__ == "__main__":
    main()
