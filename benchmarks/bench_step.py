"""One decode step of the default chat model, taken apart: MLX's own CPU ops against turbospark's
kernels, side by side in one run.

For each configuration, in its own process (OpenBLAS preloaded, as ``serve`` does), the model
reads a ``--context``-token prompt and then decodes greedily one token at a time (mlx-lm's model
code, a plain KV cache, ``--rows`` sequences side by side: one step of a batch); reported
(medians over ``--steps`` steps, configurations alternating over ``--rounds`` rounds):

- the whole step (building the graph in Python, then evaluating it) and each part;
- the matrix products alone: every linear layer and the output head once, for one row, in one
  evaluation, as the step runs them;
- the primitives one step evaluates (``mx.export_to_dot`` of the step's graph).

Configurations: ``mlx-float32`` (MLX's own ops, the float32 import, as before the kernels),
``float32`` (the kernels, the same weights), ``native`` (the kernels, the GGUF's Q4_1 blocks kept
as 4-bit: the default on the CPU).  With ``--isas``, the configurations are ``native`` on each
of the kernels' instruction sets named (``kernels.native.isas()`` lists what this CPU runs);
with ``--packing``, ``native`` with its quantized weights packed eight rows together (the default,
decision 0039) and in MLX's layout (``TURBOSPARK_KERNELS_PACKED=0``).

    python benchmarks/bench_step.py [--context 64] [--steps 64] [--rounds 3] [--rows 1]
                                    [--isas avx2+fma,avx2+avx512vnni] [--packing]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"mlx-float32": ("float32", False), "float32": ("float32", True), "native": ("native", True)}


def child(path: Path, kernels: bool, context: int, steps: int, batch: int, isa: str | None) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from turbospark.model.mlx_ggml import GgmlLinear, PackedLinear, load_model
    from turbospark.model.mlx_kernels import install

    if isa:
        from turbospark.kernels import ops

        assert ops.native is not None and ops.native.use_isa(isa), f"{isa} does not run here"
    model, _ = load_model(path)
    mx.eval(model.parameters())
    line = install(model) if kernels else "MLX's own ops"
    cache = make_prompt_cache(model)
    prompts = [[(i + 7 * r) % 1000 + 1 for i in range(context)] for r in range(batch)]
    logits = model(mx.array(prompts), cache=cache)
    token = mx.argmax(logits[:, -1], -1)
    mx.eval(token)
    build, run = [], []
    for _ in range(steps + 4):
        t0 = time.perf_counter()
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], -1)
        t1 = time.perf_counter()
        mx.eval(token)
        build.append(t1 - t0)
        run.append(time.perf_counter() - t1)
    graph = model(token[:, None], cache=cache)
    with tempfile.TemporaryDirectory() as tmp:
        mx.export_to_dot(f"{tmp}/step.dot", mx.argmax(graph[:, -1], -1))
        ops = collections.Counter(re.findall(r'label ="([A-Za-z_]+)', Path(f"{tmp}/step.dot").read_text()))
    linear = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear, GgmlLinear, PackedLinear))]
    rows = {}

    def products() -> list:
        out = []
        for m in linear:
            k = (getattr(m, "in_features", 0) or m.weight.shape[1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear)
                 else getattr(m, "in_features", None) or m.weight.shape[1])
            x = rows.setdefault(k, mx.random.normal((batch, 1, k)))
            out.append(m(x))
        out.append(model.model.embed_tokens.as_linear(rows[model.args.hidden_size]))
        return out

    mx.eval(products())
    alone = []
    for _ in range(max(8, steps // 4)):
        t0 = time.perf_counter()
        mx.eval(products())
        alone.append(time.perf_counter() - t0)
    print(json.dumps({
        "build_ms": statistics.median(build[4:]) * 1e3, "eval_ms": statistics.median(run[4:]) * 1e3,
        "step_ms": statistics.median(b + r for b, r in zip(build[4:], run[4:])) * 1e3,
        "products_ms": statistics.median(alone) * 1e3, "products": len(linear) + 1,
        "ops": sum(ops.values()), "kernels": line,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1, help="sequences decoding side by side")
    parser.add_argument("--isas", help="native on each of these instruction sets, comma-separated")
    parser.add_argument("--packing", action="store_true",
                        help="native with its quantized weights packed (the default) and in MLX's layout")
    parser.add_argument("--isa", help=argparse.SUPPRESS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.kernels, args.context, args.steps, args.rows, args.isa)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    configs = ({f"native ({isa})": ("native", True, isa) for isa in args.isas.split(",")} if args.isas
               else {"native": ("native", True, None), "native, MLX's layout": ("native", True, None)} if args.packing
               else {name: (dtype, kernels, None) for name, (dtype, kernels) in CONFIGS.items()})
    home = Path(tempfile.gettempdir()) / "bench_step"
    paths = {d: pull("smollm2-135m-instruct", ModelStore(home / d), progress=False, dtype=d).path
             for d in {dtype for dtype, _, _ in configs.values()}}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (dtype, kernels, isa) in configs.items():
            command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, __file__, "--child", str(paths[dtype]),
                       "--context", str(args.context), "--steps", str(args.steps), "--rows", str(args.rows),
                       *(["--kernels"] if kernels else []), *(["--isa", isa] if isa else [])]
            env = dict(os.environ, **({} if kernels else {"TURBOSPARK_KERNELS": "off"}),
                       **({"TURBOSPARK_KERNELS_PACKED": "0"} if "layout" in name else {}))
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"SmolLM2-135M-Instruct, {args.rows} sequence(s), {args.context} tokens of context each; "
          f"medians of {args.steps} steps, "
          f"then of {args.rounds} rounds alternating\n")
    print("| configuration | step ms | tok/s | graph build ms | evaluation ms | products alone ms | primitives a step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in ("step_ms", "build_ms", "eval_ms", "products_ms", "ops")}
        print(f"| {name} | {med['step_ms']:.1f} | {args.rows * 1e3 / med['step_ms']:.1f} | {med['build_ms']:.1f} | "
              f"{med['eval_ms']:.1f} | {med['products_ms']:.1f} ({runs[0]['products']} products) | {med['ops']:.0f} |")
    print()
    for name, runs in results.items():
        print(f"{name}: {runs[0]['kernels']}")


if __name__ == "__main__":
    main()
