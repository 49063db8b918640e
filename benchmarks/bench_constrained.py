"""What constrained decoding costs: decode speed with and without a grammar, side by side.

The same MLX backend (the default model), the same prompt and budget, sampling at temperature
0.7 with a fixed seed; one path decodes freely, the other under a JSON Schema grammar (the
llguidance mask applied as a logits processor every step).  Runs alternate, medians reported:
decode tok/s of each path, their ratio, and the grammar's own cost per token (mask and advance,
measured on the matcher alone while replaying the constrained run's tokens).

    python benchmarks/bench_constrained.py [--model smollm2-135m-instruct] [--runs 5] [--batch 1]

With ``--forced-call``, instead: the tokens a forced call takes (``tool_choice`` required) with
LangChain's ``bind_tools`` schema for ``get_weather(city)`` (no ``additionalProperties``), with
and without closing its object (decision 0017), with free and with compact whitespace: greedy,
then sampled at 0.7 with ``--runs`` seeds, each to its end or a 200-token budget.

Run it with OpenBLAS preloaded, as the server runs (``python -m turbospark.cli.blas python ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turbospark.model.backend import SamplingParams  # noqa: E402
from turbospark.model.output import Dialect, OutputParser  # noqa: E402
from turbospark.turns.structured import Grammar, closed_objects, function_tools, grammar_for  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "hobbies", "address"],
}
PROMPT = [{"role": "user", "content": "Describe a fictional person in detail, as JSON."}]


def decode(backend, prompt: list[int], params: SamplingParams, batch: int) -> tuple[float, list[list[int]]]:
    """Run ``batch`` sequences to their budget; decode tok/s (after the first token) and the
    tokens each produced."""
    sids = list(range(batch))
    for sid in sids:
        backend.insert(sid, prompt, attrs.evolve(params, seed=sid + 1))
    tokens: dict[int, list[int]] = {sid: [] for sid in sids}
    first = None
    while any(len(t) < params.max_tokens for t in tokens.values()):
        out = backend.step()
        for sid in out.tokens:
            tokens[sid] += out.emitted(sid)[: params.max_tokens - len(tokens[sid])]
        if first is None and out.tokens:
            first, decoded_at_first = time.perf_counter(), sum(len(t) for t in tokens.values())
    elapsed = time.perf_counter() - first
    for sid in sids:
        backend.remove(sid, keep_cache=False)
    return (sum(len(t) for t in tokens.values()) - decoded_at_first) / elapsed, list(tokens.values())


def matcher_cost(tokenizer, grammar, tokens: list[int]) -> float:
    """Microseconds per token of mask and advance alone, replaying ``tokens``."""
    matcher = tokenizer.grammars.matcher(grammar)
    t0 = time.perf_counter()
    for t in tokens:
        matcher.allowed()
        matcher.consume(t)
    return (time.perf_counter() - t0) / max(1, len(tokens)) * 1e6


# LangChain's bind_tools schema for get_weather(city: str)
LANGCHAIN = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _call_grammar(closed: bool, compact: bool) -> Grammar:
    """The forced-call grammar with or without the closed-object rule and compact JSON (the
    grammar before decision 0017 was neither)."""
    parameters = LANGCHAIN["function"]["parameters"]
    schema = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": closed_objects(parameters) if closed else parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    if compact:
        schema["x-guidance"] = {"whitespace_flexible": False}
    call = f'"<tool_call>" "\\n" %json{json.dumps(schema)} "\\n" "</tool_call>"'
    return Grammar(f"start: call\ncall: {call}\n", "tool_choice")


def _until_end(backend, prompt: list[int], params: SamplingParams) -> list[int]:
    backend.insert(0, prompt, params)
    out: list[int] = []
    while len(out) < params.max_tokens:
        for token in backend.step().emitted(0):
            out.append(token)
            if token in backend.tokenizer.stop_ids or len(out) == params.max_tokens:
                break
        if out and out[-1] in backend.tokenizer.stop_ids:
            break
    backend.remove(0, keep_cache=False)
    return out


def forced_call(backend, runs: int) -> None:
    tok = backend.tokenizer
    tools = function_tools([LANGCHAIN])
    prompt = tok.encode_chat(QUESTION, tools=list(tools))
    now = grammar_for(tools=tools, call_required=True)
    assert now.lark == _call_grammar(True, True).lark, "grammar_for no longer writes the benchmarked grammar"
    budget = 200
    print(f"forced call, LangChain's get_weather schema, {budget}-token budget; greedy, then {runs} seeds at 0.7")
    print(f"shortest valid call: {tok.grammars.least_tokens(now)} tokens (its end included)")
    print("| objects | whitespace | greedy: tokens, call | sampled: median tokens, calls parsed | greedy text |")
    print("| --- | --- | --- | --- | --- |")
    for closed in (False, True):
        for compact in (False, True):
            grammar = _call_grammar(closed, compact)
            results = []
            for seed in [None, *range(1, runs + 1)]:
                params = SamplingParams(max_tokens=budget, temperature=0.0 if seed is None else 0.7,
                                        seed=seed, grammar=grammar)
                tokens = _until_end(backend, prompt, params)
                parser = OutputParser(Dialect(), tools=tools)
                parts = parser.feed(tok.decode_visible(tokens)) + parser.finish()
                results.append((len(tokens), bool(parts.calls), tok.decode_visible(tokens)))
            greedy, sampled = results[0], results[1:]
            shown = greedy[2] if len(greedy[2]) < 90 else greedy[2][:87] + "..."
            print(f"| {'closed' if closed else 'open'} | {'compact' if compact else 'free'} | "
                  f"{greedy[0]}, {'yes' if greedy[1] else 'no'} | "
                  f"{statistics.median(n for n, _, _ in sampled):.0f}, {sum(ok for _, ok, _ in sampled)}/{runs} | "
                  f"{json.dumps(shown)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--forced-call", action="store_true", help="tokens a forced call takes, with and without closed objects")
    parser.add_argument("--path", type=Path, help="a stored model directory, instead of pulling --model")
    args = parser.parse_args()

    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    if args.path is not None:
        backend = MlxBackend(args.path, model_id=args.path.name)
    else:
        home = Path(os.environ.get("TURBOSPARK_HOME", Path.home() / ".cache" / "turbospark"))
        stored = pull(args.model, ModelStore(home / "models"), progress=False)
        backend = MlxBackend(stored.path, model_id=stored.name)
    if args.forced_call:
        forced_call(backend, args.runs)
        return
    tok = backend.tokenizer
    prompt = tok.encode_chat(PROMPT)
    grammar = grammar_for(json_schema=SCHEMA)
    tok.grammars.compile(grammar)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.7)
    bound = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, grammar=grammar)
    # Both paths decode exactly max_tokens: the backend never stops a sequence by itself (once
    # the JSON is complete the grammar holds the constrained one at its end token).
    decode(backend, prompt, free, args.batch)  # warm-up
    decode(backend, prompt, bound, args.batch)
    results: dict[str, list[float]] = {"free": [], "grammar": []}
    replay: list[int] = []
    for _ in range(args.runs):
        results["free"].append(decode(backend, prompt, free, args.batch)[0])
        tps, produced = decode(backend, prompt, bound, args.batch)
        results["grammar"].append(tps)
        replay = produced[0]
    end = tok.eos_id
    replay = replay[: replay.index(end)] if end in replay else replay
    mask_us = statistics.median(matcher_cost(tok, grammar, replay) for _ in range(args.runs))
    free_tps, bound_tps = (statistics.median(results[k]) for k in ("free", "grammar"))
    print(f"model {backend.model_id}, batch {args.batch}, {args.max_tokens} tokens, {args.runs} runs (medians)")
    print("| path | decode tok/s | vs free |")
    print("| --- | --- | --- |")
    print(f"| free sampling | {free_tps:.1f} | 1.000 |")
    print(f"| JSON Schema grammar | {bound_tps:.1f} | {bound_tps / free_tps:.3f} |")
    print(f"grammar alone: {mask_us:.0f} us per token (mask and advance, {len(replay)} tokens replayed); "
          f"a free decode step takes {1e6 / free_tps * args.batch:.0f} us")


if __name__ == "__main__":
    main()
