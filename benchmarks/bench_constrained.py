"""What constrained decoding costs: decode speed with and without a grammar, side by side.

The same MLX backend (the default model), the same prompt and budget, sampling at temperature
0.7 with a fixed seed; one path decodes freely, the other under a JSON Schema grammar (the
llguidance mask applied as a logits processor every step).  Runs alternate, medians reported:
decode tok/s of each path, their ratio, and the grammar's own cost per token (mask and advance,
measured on the matcher alone while replaying the constrained run's tokens).

    python benchmarks/bench_constrained.py [--model smollm2-135m-instruct] [--runs 5] [--batch 1]

Run it with OpenBLAS preloaded, as the server runs (``python -m turbospark.cli.blas python ...``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turbospark.model.backend import SamplingParams  # noqa: E402
from turbospark.turns.structured import grammar_for  # noqa: E402

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
        for sid, token in out.tokens.items():
            if len(tokens[sid]) < params.max_tokens:
                tokens[sid].append(token)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    home = Path(os.environ.get("TURBOSPARK_HOME", Path.home() / ".cache" / "turbospark"))
    stored = pull(args.model, ModelStore(home / "models"), progress=False)
    backend = MlxBackend(stored.path, model_id=stored.name)
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
    print(f"model {stored.name}, batch {args.batch}, {args.max_tokens} tokens, {args.runs} runs (medians)")
    print("| path | decode tok/s | vs free |")
    print("| --- | --- | --- |")
    print(f"| free sampling | {free_tps:.1f} | 1.000 |")
    print(f"| JSON Schema grammar | {bound_tps:.1f} | {bound_tps / free_tps:.3f} |")
    print(f"grammar alone: {mask_us:.0f} us per token (mask and advance, {len(replay)} tokens replayed); "
          f"a free decode step takes {1e6 / free_tps * args.batch:.0f} us")


if __name__ == "__main__":
    main()
