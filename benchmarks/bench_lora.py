"""Decoding with LoRA adapters (``serve --lora``, decision 0046) against without, side by side in
one run: the default chat model as the CPU serves it (SmolLM2-135M-Instruct, its GGUF's Q4_1
blocks kept as 4-bit, the kernels' fused layers), with adapters made by mlx-lm's own LoRA layers
(``linear_to_lora_layers``: rank 8 on every linear layer of the last 16 layers, mlx-lm's
defaults).

Each configuration is the raw engine (``MlxBackend``, no HTTP), greedy, prompt lookup off: N
sequences read a ``--context``-token prompt, then decode ``--steps`` tokens each; reported is
the decode's tokens a second, all sequences together (medians of ``--rounds`` rounds, the
configurations alternating):

- ``no adapters``: the model loaded without any;
- ``adapters loaded, none used``: with two adapters loaded, the rows using none;
- ``one adapter``: every row with the same adapter;
- ``mixed``: half the rows without, the others alternating between the two adapters.

    python -m turbospark.cli.blas python benchmarks/bench_lora.py [--rows 1,8] [--context 64]
                                                                   [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def _adapter(path: Path, folder: Path, seed: int) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from turbospark.model.mlx_ggml import load_model

    model, _ = load_model(path)
    model.freeze()
    params = {"rank": 8, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 16, params)
    mx.random.seed(seed)
    model.load_weights([(n, 0.01 * mx.random.normal(p.shape)) for n, p in tree_flatten(model.trainable_parameters())
                        if n.endswith("lora_b")], strict=False)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (folder / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 16,
                                                            "lora_parameters": params}))
    return folder


def _prompts(rows: int, context: int) -> list[list[int]]:
    return [[(j * 7 + i * 13) % 1000 + 1 for j in range(context)] for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8", help="sequences decoding together, comma-separated")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks._engine import decode_rate
    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.store.adapter_files import read_adapters
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    home = Path(tempfile.gettempdir()) / "bench_lora"
    path = pull("smollm2-135m-instruct", ModelStore(home / "store"), progress=False, dtype="native").path
    folders = [("a", _adapter(path, home / "a", 1)), ("b", _adapter(path, home / "b", 2))]
    plain = MlxBackend(path, model_id="plain")
    adapted = MlxBackend(path, model_id="adapted", adapters=read_adapters(path, folders))
    configs = {
        "no adapters": (plain, lambda i: ()),
        "adapters loaded, none used": (adapted, lambda i: ()),
        "one adapter": (adapted, lambda i: ((0, 1.0),)),
        "mixed": (adapted, lambda i: () if i % 2 == 0 else (((i // 2) % 2, 1.0),)),
    }
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[tuple[str, int], list[float]] = {(name, n): [] for name in configs for n in rows}
    for name, (backend, chosen) in configs.items():  # warm: every shape once
        for n in rows:
            decode_rate(backend, _prompts(n, args.context), 8, chosen)
    for _ in range(args.rounds):
        for n in rows:
            for name, (backend, chosen) in configs.items():
                results[name, n].append(decode_rate(backend, _prompts(n, args.context), args.steps, chosen))
    print(f"SmolLM2-135M-Instruct (Q4_1 blocks as 4-bit, the kernels), {args.context} tokens of context, "
          f"{args.steps} decode steps; medians of {args.rounds} rounds alternating\n{adapted.kernels}\n")
    print("| rows | " + " | ".join(configs) + " |")
    print("| --- |" + " --- |" * len(configs))
    for n in rows:
        base = statistics.median(results["no adapters", n])
        cells = [f"{statistics.median(results[name, n]):.1f} tok/s ({statistics.median(results[name, n]) / base:.2f}x)"
                 for name in configs]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
