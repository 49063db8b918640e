"""Which stored form of the default chat model to serve on the CPU: quality against float32 and
decode speed, side by side in one run.

The catalogue's SmolLM2 comes as a Q4_1 GGUF.  Each ``--dtypes`` form is imported from that same
file into a store of its own (``float32`` and ``bfloat16``: the Q4_1 weights widened; ``native``:
the Q4_1 blocks kept as MLX's affine 4-bit layout, group 32, losslessly; ``q8`` and ``q4``:
widened, then re-quantized by MLX with group 64).  Then, for each form, through the same MLX
model code with turbospark's CPU kernels (``TURBOSPARK_KERNELS=off`` runs MLX's own ops):

- log-likelihood: the mean negative log-likelihood per token of a fixed set of texts (the
  README's opening paragraphs as decision 0028 measured them,
  ``benchmarks/data/likelihood-text.md``, and three of this file's own sentences), and its difference from
  float32's;
- greedy agreement: for a fixed set of chat prompts, how many of the first ``--tokens`` greedy
  tokens equal float32's (the count up to the first difference, summed over the prompts), and
  the largest logit difference from float32 at the positions before it;
- decode speed: one stream's tokens per second over the same greedy runs (medians), and the
  bytes of weights.

Each form runs in its own process, in turn, after the imports; OpenBLAS is preloaded as ``serve``
does.

    python benchmarks/bench_dtypes.py [--dtypes float32,native,q8,q4,bfloat16] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List three uses of copper and say why.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
]


def texts() -> list[str]:
    readme = (ROOT / "benchmarks" / "data" / "likelihood-text.md").read_text().split("\n\n")
    prose = [p for p in readme if p and p[0].isalpha()][:4]
    own = [
        "Each form runs in its own process, in turn, after the imports.",
        "The catalogue's SmolLM2 comes as a Q4_1 GGUF, imported into a store of its own.",
        "Then, for each form, through the same model code with the CPU kernels.",
    ]
    return prose + own


def child(model_dir: Path, tokens: int) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx.utils import tree_flatten

    from turbospark.model.mlx_ggml import load_model
    from turbospark.model.mlx_kernels import install
    from turbospark.model.tokenizer import Tokenizer

    model, _ = load_model(model_dir)
    mx.eval(model.parameters())
    line = install(model)
    tok = Tokenizer.from_dir(model_dir)
    nll = []
    for text in texts():
        ids = tok.encode(text, add_bos=True)
        logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll.append(-float(mx.mean(mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1))))
    runs = []
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[:, -1]
        out, rows = [], []
        t0 = None
        for _ in range(tokens):
            nxt = mx.argmax(logits, axis=-1)
            mx.eval(nxt, logits)
            rows.append(np.array(logits[0].astype(mx.float32)))
            out.append(int(nxt.item()))
            if t0 is None:
                t0 = time.perf_counter()
            logits = model(nxt[:, None], cache=cache)[:, -1]
        mx.eval(logits)
        runs.append({"tokens": out, "seconds": time.perf_counter() - t0, "logits": [r.tolist() for r in rows]})
    size = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    print(json.dumps({"nll": nll, "runs": runs, "bytes": size, "kernels": line}))


def imported(dtype: str, home: Path) -> Path:
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    return pull("smollm2-135m-instruct", ModelStore(home / dtype), progress=False, dtype=dtype).path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,native,q8,q4,bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--home", type=Path, help="where the stores are kept (default: a temporary folder)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens)
    dtypes = args.dtypes.split(",")
    home = args.home or Path(tempfile.mkdtemp(prefix="bench_dtypes."))
    paths = {d: imported(d, home) for d in dtypes}
    results = {}
    for dtype in dtypes:
        command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, __file__, "--child", str(paths[dtype]),
                   "--tokens", str(args.tokens)]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ, check=True)
        results[dtype] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("float32")
    print(f"SmolLM2-135M-Instruct from its Q4_1 GGUF; {len(texts())} texts, {len(PROMPTS)} prompts x {args.tokens} greedy tokens\n")
    print("| stored as | weights MB | mean NLL/token | vs float32 | greedy tokens as float32's | largest logit difference before it | decode tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, r in results.items():
        nll = statistics.mean(r["nll"])
        speed = statistics.median((len(run["tokens"]) - 1) / run["seconds"] for run in r["runs"])
        agree, logit = "", ""
        if base is not None:
            same = total = 0
            worst = 0.0
            for mine, ref in zip(r["runs"], base["runs"]):
                n = next((i for i, (a, b) in enumerate(zip(mine["tokens"], ref["tokens"])) if a != b), len(ref["tokens"]))
                same += n
                total += len(ref["tokens"])
                for i in range(min(n + 1, len(ref["tokens"]))):
                    worst = max(worst, max(abs(a - b) for a, b in zip(mine["logits"][i], ref["logits"][i])))
            agree, logit = f"{same}/{total}", f"{worst:.2e}"
        delta = f"{nll - statistics.mean(base['nll']):+.5f}" if base is not None else ""
        print(f"| {dtype} | {r['bytes'] / 1e6:.0f} | {nll:.5f} | {delta} | {agree} | {logit} | {speed:.1f} |")
    print(f"\nkernels: {next(iter(results.values()))['kernels']}")


if __name__ == "__main__":
    main()
