"""Time to the first streamed piece of a turn that offers tools and answers in prose, beside the
same turn without tools: the headline of live tool streams.

The in-process server on the real default model (SmolLM2-135M-Instruct, float32), greedy, the
same question three ways, runs alternating: with a ``get_weather`` tool; without tools; and
without tools but with the very prompt the tools make (their preamble written into the system
message by hand), so that prefill costs the same and only the streaming differs.  Every run
of every path opens with a distinct line, so the prefix cache cannot help any path (the tools
path and the same-prompt path would otherwise share their whole prompt within a run).  Per
path, medians: the first byte (the role chunk, sent once the model started), the first content
piece, the whole stream, and the prompt's length.  Before live tool streams, a tool turn sent nothing until the
whole generation was done.

    python -m turbospark.cli.blas python benchmarks/bench_tool_stream.py [--runs 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = "Write four short lines about the sea at night."


PATHS = {"tools": "with tools", "plain": "without tools", "same": "without tools, the same prompt"}


async def one(client: Any, url: str, model: str, run: int, path: str, max_tokens: int) -> dict[str, float]:
    from turbospark.model.tool_preamble import tools_in_preamble

    messages = [{"role": "system", "content": f"Run {run}{path[0]}. You are a poet."}, {"role": "user", "content": QUESTION}]
    body: dict[str, Any] = {
        "model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
        "stream_options": {"include_usage": True}, "messages": messages,
    }
    if path == "tools":
        body["tools"] = [WEATHER]
    elif path == "same":
        body["messages"] = tools_in_preamble(messages, [WEATHER])
    t0 = time.perf_counter()
    first_byte = first_piece = None
    called = False
    usage: dict[str, int] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first_byte is None:
                first_byte = time.perf_counter() - t0
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                called |= "tool_calls" in delta
                if first_piece is None and (delta.get("content") or delta.get("reasoning_content")):
                    first_piece = time.perf_counter() - t0
    end = time.perf_counter() - t0
    if called:
        raise SystemExit("the model called the tool: pick a question it answers in prose")
    return {"first_byte": first_byte or end, "first_piece": first_piece or end, "whole": end,
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0)}


async def bench(model_dir: Path, name: str, runs: int, max_tokens: int) -> None:
    import httpx

    from turbospark.config import Settings
    from turbospark.model.backend import BackendSpec
    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.server import serve

    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(
            serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
            [BackendSpec(name, lambda: MlxBackend(model_dir, model_id=name))],
        ))
        results: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
        async with httpx.AsyncClient(timeout=600) as client:
            for path in PATHS:  # warm-up
                sample = await one(client, server.url, name, -1, path, max_tokens)
                print(f"warm-up, {PATHS[path]}: {sample}", file=sys.stderr)
            for run in range(runs):
                order = list(PATHS)[run % 3:] + list(PATHS)[: run % 3]
                for path in order:
                    results[path].append(await one(client, server.url, name, run, path, max_tokens))
        server.stop.set()

    def med(path: str, key: str) -> float:
        return statistics.median(r[key] for r in results[path])

    print(f"model {name}, greedy, up to {max_tokens} tokens, {runs} runs per path (medians)")
    print("| path | prompt tokens | completion tokens | first byte (ms) | first content piece (ms) | whole stream (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path, label in PATHS.items():
        print(f"| {label} | {med(path, 'prompt_tokens'):.0f} | {med(path, 'completion_tokens'):.0f} "
              f"| {med(path, 'first_byte') * 1e3:.0f} | {med(path, 'first_piece') * 1e3:.0f} | {med(path, 'whole') * 1e3:.0f} |")
    for key, what in (("first_byte", "first byte"), ("first_piece", "first content piece")):
        print(f"{what}, with tools / without: {med('tools', key) / med('plain', key):.2f}x; "
              f"with tools / the same prompt without: {med('tools', key) / med('same', key):.2f}x (target: within 1.2x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
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
    trio.run(bench, model_dir, name, args.runs, args.max_tokens)


if __name__ == "__main__":
    main()
