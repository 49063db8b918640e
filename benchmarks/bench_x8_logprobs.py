"""How far x rounded to 8 bits moves a model's log-probabilities: turbospark's kernels and
llama.cpp's own dot products on the very same GGUF, each against MLX's own ops with x in float32.

The reference is the default model's GGUF (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 head) imported
with its blocks kept (``native``) and run by mlx-lm with MLX's own ops (``kernels.mlx_own_ops``):
x in float32.  For each prompt of ``tests/test_mlx_kernels.py`` it decodes ``--new`` tokens
greedily; then each side reads the same ids (the prompt, then the reference's tokens, one token a
step, a float32 KV cache) and at each step gives its log-probabilities.  Reported, for each side:
the largest and the median difference from the reference over each step's 20 likeliest tokens
(the side's own 20, as the test takes them), and where the side's own greedy text parts from the
reference's (free-running, x in 8 bits) and how far apart the reference's top two are there.

- turbospark: the kernels installed in the same model (``mlx_kernels.installed``), x in 8 bits
  (its default where the CPU has integer products; ``TURBOSPARK_KERNELS_EXACT`` must be unset).
- llama.cpp: llama-cpp-python in its own venv (``$LLAMA_CPP_VENV``, default
  ``tests/.cache/llama-cpp/venv``), which rounds x to 8 bits per 32 values (Q8_1 beside Q4_1,
  Q8_0 beside Q8_0) on every CPU; build it natively (``CMAKE_ARGS=-DGGML_NATIVE=ON``) or with
  ``scripts/check-against-llama-cpp``.  It prints the instruction sets llama.cpp was built with.

The figures set ``BOUND["int8"]`` of ``tests/test_mlx_kernels.py`` (decision 0040).

    python benchmarks/bench_x8_logprobs.py [--new 24] [--threads 2]
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _gguf import catalogue_gguf  # noqa: E402  (the scripts' folder is on sys.path)

from tests.test_mlx_kernels import PROMPTS  # noqa: E402

TOP = 20


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    top = rows.max(-1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(-1, keepdims=True))


def reference(model, prompts: list[list[int]], new: int) -> list[tuple[list[int], np.ndarray]]:
    """MLX's own ops: greedy tokens and each step's log-probabilities."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from turbospark.kernels import ops as kernels

    out = []
    with kernels.mlx_own_ops():
        for ids in prompts:
            cache = make_prompt_cache(model)
            logits = model(mx.array([ids]), cache=cache)[0, -1]
            tokens, rows = [], []
            for _ in range(new):
                rows.append(np.array(logits.astype(mx.float32)))
                tokens.append(int(np.argmax(rows[-1])))
                logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
            out.append((tokens, log_softmax(np.stack(rows))))
    return out


def ours(model, prompts: list[list[int]], paths: list[list[int]]) -> tuple[list[np.ndarray], list[list[int]]]:
    """The kernels, x in 8 bits, float32 KV cache: log-probabilities along each reference path,
    and the greedy text of their own."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from turbospark.kernels import ops as kernels
    from turbospark.model.mlx_kernels import installed

    def read(ids: list[int], path: list[int], follow: bool) -> tuple[np.ndarray, list[int]]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0, -1]
        rows, tokens = [], []
        for token in path:
            rows.append(np.array(logits.astype(mx.float32)))
            tokens.append(token if follow else int(np.argmax(rows[-1])))
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        return log_softmax(np.stack(rows)), tokens

    kernels.set_kv_half(False)
    with installed(model) as line:
        print(f"turbospark: {line}", file=sys.stderr)
        assert kernels.x_in_8_bits(), "x is not rounded to 8 bits here (TURBOSPARK_KERNELS_EXACT, or no integer products)"
        rows = [read(ids, path, True)[0] for ids, path in zip(prompts, paths)]
        texts = [read(ids, path, False)[1] for ids, path in zip(prompts, paths)]
    return rows, texts


def llama_cpp(gguf: Path, prompts: list[list[int]], paths: list[list[int]], threads: int
              ) -> tuple[list[np.ndarray], list[list[int]]] | None:
    venv = Path(os.environ.get("LLAMA_CPP_VENV") or ROOT / "tests" / ".cache" / "llama-cpp" / "venv")
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"llama.cpp: skipped, no llama-cpp-python in {venv}", file=sys.stderr)
        return None
    info = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, check=True)
    print(f"llama.cpp: {info.stdout.strip()}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as work:
        request = {"kind": "score", "model": str(gguf), "n_ctx": 512, "threads": threads,
                   "tokens": [ids + path for ids, path in zip(prompts, paths)], "from": [len(ids) for ids in prompts]}
        Path(work, "request.json").write_text(json.dumps(request))
        subprocess.run([str(python), str(ROOT / "scripts" / "llama_cpp_reference.py"), str(Path(work, "request.json")),
                        "--out", str(Path(work, "score.npz"))], check=True)
        scores = np.load(Path(work, "score.npz"))
        rows = [log_softmax(scores[f"logits_{i}"][:len(path)]) for i, path in enumerate(paths)]
        # its own greedy text, from the same ids
        request = {"kind": "generate", "model": str(gguf), "n_ctx": 512, "threads": threads, "ids": prompts,
                   "n_predict": len(paths[0])}
        Path(work, "request.json").write_text(json.dumps(request))
        subprocess.run([str(python), str(ROOT / "scripts" / "llama_cpp_reference.py"), str(Path(work, "request.json")),
                        "--out", str(Path(work, "greedy.npz"))], check=True)
        greedy = np.load(Path(work, "greedy.npz"))
        texts = [greedy[f"tokens_{i}"][len(ids):].tolist() for i, ids in enumerate(prompts)]
    return rows, texts


def compare(name: str, rows: list[np.ndarray], texts: list[list[int]], want: list[tuple[list[int], np.ndarray]]) -> float:
    worst = 0.0
    for p, (mine, text, (path, theirs)) in enumerate(zip(rows, texts, want)):
        diffs = []
        for step in range(len(path)):
            top = np.argsort(mine[step])[-TOP:]
            diffs.append(float(np.abs(mine[step][top] - theirs[step][top]).max()))
        parted = next((i for i, (a, b) in enumerate(zip(text, path)) if a != b), None)
        where = "never parts" if parted is None else (
            f"parts at token {parted}, where the reference's top two are "
            f"{float(np.diff(np.sort(theirs[parted])[-2:])[0]):.3f} apart")
        print(f"{name:10s} prompt {p}: largest {max(diffs):.3f}, median {statistics.median(diffs):.3f} "
              f"(steps 1-{len(path)}); its own text {where}")
        worst = max(worst, max(diffs))
    print(f"{name:10s} largest over every prompt and step: {worst:.3f}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=24, help="tokens decoded per prompt")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = parser.parse_args()

    from turbospark.model.mlx_ggml import load_model
    from turbospark.model.tokenizer import Tokenizer
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore, store_root

    stored = pull("smollm2-135m-instruct", ModelStore(store_root()), dtype="native")
    tok = Tokenizer.from_dir(stored.path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    model, _ = load_model(stored.path)
    want = reference(model, prompts, args.new)
    paths = [tokens for tokens, _ in want]
    rows, texts = ours(model, prompts, paths)
    compare("turbospark", rows, texts, want)
    theirs = llama_cpp(catalogue_gguf("smollm2-135m-instruct"), prompts, paths, args.threads)
    if theirs is not None:
        compare("llama.cpp", *theirs, want)


if __name__ == "__main__":
    main()
