"""Time to first token of an agent's first turn after a restart, with and without the prompt
cache on disk (``--prompt-cache-dir``): the headline of the persistent prompt cache.

The in-process server on the real default model (SmolLM2-135M-Instruct, float32), greedy, an
agent's ~2,000-token system prompt (instructions and a tool list written out), a new question
each run.  Each run restarts the server (a new backend, loaded afresh) twice, alternating: with
the directory a previous run filled, and without one.  Per path, medians: the load (start of
the server, reading the cache back included), the first streamed token, and the cached tokens.

    python -m turbospark.cli.blas python benchmarks/bench_prompt_cache.py [--runs 3] [--path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ["read_file", "write_file", "list_directory", "search_code", "run_tests", "run_shell", "git_diff", "git_commit"]


def agent_prompt(target_tokens: int, count: Any) -> str:
    """Instructions and a tool list, grown until the tokenizer counts ``target_tokens``."""
    lines = ["You are a careful coding agent working in a user's repository. Follow these rules."]
    n = 0
    while count("\n".join(lines)) < target_tokens:
        tool = TOOLS[n % len(TOOLS)]
        lines.append(
            f"Tool {n}: {tool}. Arguments: path (string, relative to the repository root), "
            f"options (object). Use {tool} only when the task needs it; explain why in one line, "
            f"and never run it twice with the same arguments in one turn. Rule {n}: keep edits small."
        )
        n += 1
    return "\n".join(lines)


async def turn(model_dir: Path, name: str, system: str, question: str, cache_dir: Path | None) -> dict[str, float]:
    import httpx

    from turbospark.config import Settings
    from turbospark.model.backend import BackendSpec
    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.server import serve

    def make() -> MlxBackend:
        return MlxBackend(model_dir, model_id=name, prompt_cache_dir=cache_dir)

    body = {
        "model": name, "stream": True, "temperature": 0, "max_tokens": 8,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
                                             [BackendSpec(name, make)]))
        loaded = time.perf_counter() - t0
        first = None
        usage: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=600) as client:
            t1 = time.perf_counter()
            async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                        first = time.perf_counter() - t1
        server.stop.set()
    stopped = time.perf_counter() - t0
    return {"load": loaded, "ttft": first or float("nan"), "prompt": usage.get("prompt_tokens", 0),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0), "whole": stopped}


async def bench(model_dir: Path, name: str, runs: int, tokens: int) -> None:
    from turbospark.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    system = agent_prompt(tokens, lambda text: len(tokenizer.encode(text)))
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp)
        warm = await turn(model_dir, name, system, "Which tools do you have?", cache_dir)
        print(f"filling the cache: {warm}", file=sys.stderr)
        results: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
        for run in range(runs):
            question = f"Task {run}: find where the config file is read, and summarise it."
            for path in (("with", "without") if run % 2 == 0 else ("without", "with")):
                results[path].append(await turn(model_dir, name, system, question, cache_dir if path == "with" else None))
                print(f"run {run}, {path}: {results[path][-1]}", file=sys.stderr)
        on_disk = sum(f.stat().st_size for f in cache_dir.rglob("*.safetensors"))

    def med(path: str, key: str) -> float:
        return statistics.median(r[key] for r in results[path])

    print(f"model {name}, a {med('with', 'prompt'):.0f}-token first turn after a restart, {runs} runs per path (medians)")
    print("| after a restart | cached tokens | load (ms) | first token (ms) |")
    print("| --- | --- | --- | --- |")
    for path, label in (("without", "without the prompt cache on disk"), ("with", "with --prompt-cache-dir")):
        print(f"| {label} | {med(path, 'cached'):.0f} | {med(path, 'load') * 1e3:.0f} | {med(path, 'ttft') * 1e3:.0f} |")
    print(f"first token, without / with: {med('without', 'ttft') / med('with', 'ttft'):.1f}x; "
          f"on disk: {on_disk / 1e6:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2000, help="the system prompt's length")
    parser.add_argument("--path", type=Path, help="a stored model directory, instead of pulling --model")
    args = parser.parse_args()
    if args.path is not None:
        model_dir, name = args.path, args.path.name
    else:
        from turbospark.store.pull import pull
        from turbospark.store.store import ModelStore

        home = Path(os.environ.get("TURBOSPARK_HOME", Path.home() / ".cache" / "turbospark"))
        stored = pull(args.model, ModelStore(home / "models"), progress=False, dtype="float32")
        model_dir, name = stored.path, stored.name
    trio.run(bench, model_dir, name, args.runs, args.tokens)


if __name__ == "__main__":
    main()
