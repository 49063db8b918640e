"""The fused layers' KV cache types side by side (``serve --kv-cache``, decision 0047): float16
(the default), llama.cpp's q8_0 and q4_0 blocks, on the default chat model as the CPU serves it
(SmolLM2-135M-Instruct, its GGUF's Q4_1 blocks kept as 4-bit, the kernels' fused layers).

For each type, in its own process (OpenBLAS preloaded, as ``serve`` does):

- quality: the mean negative log-likelihood per token of ``benchmarks/data/likelihood-text.md``,
  read in chunks of 128 tokens through the cache (every chunk's attention reads the earlier
  ones' keys and values as the cache holds them), and its difference from float16's; greedy
  agreement with float16 over six chat prompts' answers (to their end, at most ``--tokens``
  tokens: tokens equal until the first difference, and whole answers equal);
- memory: the cache's bytes per 1,000 tokens of context (``MlxBackend.kv_estimate``);
- speed: one sequence's decode, greedy, after a ``--context``-token prompt (tokens a second, a
  median of ``--steps`` steps), then 8 sequences' decode after 512 tokens each.

    python -m turbospark.cli.blas python benchmarks/bench_kv_cache.py [--context 4096] [--steps 32]
                                                                       [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("f16", "q8_0", "q4_0")
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is to a new programmer.",
    "List three uses of a local language model.",
    "Translate 'good morning' into Spanish and French.",
]


def child(path: Path, kind: str, context: int, steps: int, tokens: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    sys.path.insert(0, str(ROOT))
    from benchmarks._engine import decode_rate
    from turbospark.kernels import ops
    from turbospark.model.backend import SamplingParams
    from turbospark.model.mlx_backend import MlxBackend

    ops.set_kv_cache(kind)
    backend = MlxBackend(path, model_id="bench")
    model, tok = backend.model, backend.tokenizer
    ids = tok.encode((ROOT / "benchmarks" / "data" / "likelihood-text.md").read_text(), add_bos=True)
    cache, nll = make_prompt_cache(model), []
    with mx.stream(backend.stream):
        for at in range(0, len(ids) - 1, 128):
            chunk = ids[at: at + 129]
            logits = model(mx.array([chunk[:-1]]), cache=cache)[0].astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll += (-mx.take_along_axis(logp, mx.array(chunk[1:])[:, None], axis=-1)[:, 0]).tolist()
    answers = []
    for prompt in PROMPTS:
        backend.insert(0, tok.encode_chat([{"role": "user", "content": prompt}]),
                       SamplingParams(max_tokens=tokens, temperature=0.0, speculative=False))
        out: list[int] = []
        while len(out) < tokens:
            out += list(backend.step().tokens.values())
        backend.remove(0, keep_cache=False)
        ends = [i for i, t in enumerate(out[:tokens]) if t in tok.stop_ids]
        answers.append(out[: ends[0] + 1] if ends else out[:tokens])  # the answer, to its end
    long = [[(j * 7) % 1000 + 1 for j in range(context)]]
    one = decode_rate(backend, long, steps)
    eight = decode_rate(backend, [[(j * 7 + i * 13) % 1000 + 1 for j in range(512)] for i in range(8)], steps)
    print(json.dumps({"nll": statistics.fmean(nll), "answers": answers, "per_1000": backend.kv_estimate(1000),
                      "one": one, "eight": eight, "kernels": backend.kernels}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.kind, args.context, args.steps, args.tokens)
    sys.path.insert(0, str(ROOT))
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    path = pull("smollm2-135m-instruct", ModelStore(Path(tempfile.gettempdir()) / "bench_kv" / "store"),
                progress=False, dtype="native").path
    results = {}
    for kind in KINDS:
        command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, __file__, "--child", str(path),
                   "--kind", kind, "--context", str(args.context), "--steps", str(args.steps),
                   "--tokens", str(args.tokens)]
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ))
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results["f16"]
    print(f"SmolLM2-135M-Instruct (Q4_1 blocks as 4-bit, the kernels); {args.context}-token context for one "
          f"sequence, 512 each for 8; medians of {args.steps} steps\n")
    print("| KV cache | NLL per token (vs f16) | greedy tokens equal to f16's | answers equal | "
          "bytes per 1,000 tokens | 1 sequence tok/s | 8 sequences tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, r in results.items():
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(r["answers"], base["answers"])]
        total = sum(len(y) for y in base["answers"])
        whole = sum(x == y for x, y in zip(r["answers"], base["answers"]))
        print(f"| {kind} | {r['nll']:.4f} ({r['nll'] - base['nll']:+.4f}) | {sum(same)} of {total} "
              f"| {whole} of {len(same)} | {r['per_1000'] / 1e6:.2f} MB ({r['per_1000'] / base['per_1000']:.2f}x) "
              f"| {r['one']:.1f} ({r['one'] / base['one']:.2f}x) | {r['eight']:.1f} ({r['eight'] / base['eight']:.2f}x) |")
    print()
    for kind, r in results.items():
        print(f"{kind}: {r['kernels']}")


if __name__ == "__main__":
    main()
