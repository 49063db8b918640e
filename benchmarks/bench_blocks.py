"""The products of each GGUF block type, side by side in one process: ggml's rows through the
kernels (``kernels.blocks``), the kernels' own packed forms of Q4_K, Q5_K, Q5_0 and Q6_K
(``model.mlx_ggml``), their packed affine layout (what the store re-lays Q4_0, Q4_1 and Q8_0
into, and Q4_K before decision 0041), and bfloat16 (what the other types were widened to).

For each shape (N x K: a 1.7B model's q/o, gate/up and down by default) and number of rows of
x, the median time of one product over ``--repeat`` evaluations, forms alternating; reported as
GMAC/s (multiply-adds a second) and the weights' bytes a value (bits).  Two threads unless the
kernels are told otherwise (``TURBOSPARK_KERNEL_THREADS``).

    python benchmarks/bench_blocks.py [--rows 1,8,16,64] [--repeat 30] [--shapes 2048x2048,8192x2048,2048x8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import mlx.core as mx
import numpy as np

from turbospark.kernels import blocks
from turbospark.kernels import ops as kernels
from turbospark.model import mlx_ggml

Q = gguf.GGMLQuantizationType
GGML_FORMS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]


def forms(n: int, k: int) -> dict[str, tuple[callable, int]]:
    """name -> (product of x, weight bytes)"""
    w = mx.random.normal((n, k)) / k**0.5
    out: dict[str, tuple[callable, int]] = {}
    for qtype in GGML_FORMS:
        q = blocks.quantize(w, qtype)
        mx.eval(q)
        out[f"ggml {qtype.name}"] = ((lambda x, q=q, t=qtype: blocks.linear(x, q, t, k)), q.nbytes)
    raw = {t: np.array(blocks.quantize(w, t)) for t in (Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q6_K)}
    k4 = mlx_ggml.pack_k4(raw[Q.Q4_K])
    k5k = mlx_ggml.pack_k5k(raw[Q.Q5_K])
    k5 = mlx_ggml.pack_k5(raw[Q.Q5_0], Q.Q5_0)
    k6 = mlx_ggml.pack_k6(raw[Q.Q6_K])
    mx.eval(*k4, *k5k, *k5, *k6)
    out["ours Q4_K packed"] = ((lambda x: blocks.k4_linear(x, *k4)), sum(a.nbytes for a in k4))
    out["ours Q5_K packed"] = ((lambda x: blocks.k5k_linear(x, *k5k)), sum(a.nbytes for a in k5k))
    out["ours Q5_0 packed"] = ((lambda x: blocks.k5_linear(x, *k5)), sum(a.nbytes for a in k5))
    out["ours Q6_K packed"] = ((lambda x: blocks.k6_linear(x, *k6)), sum(a.nbytes for a in k6))
    for bits in (4, 8):
        wq, s, b = mx.quantize(w, group_size=32, bits=bits)
        packed = kernels.pack_quantized(wq, s.astype(mx.float32), b.astype(mx.float32), 32, bits)
        mx.eval(packed)
        size = sum(a.nbytes for a in packed)
        out[f"ours affine {bits}-bit (f32 scales)"] = (
            (lambda x, p=packed, bits=bits: kernels.quantized_linear(x, *p, group_size=32, bits=bits, packed=True)), size)
    wb = w.astype(mx.bfloat16)
    mx.eval(wb)
    out["bfloat16 (widened)"] = ((lambda x: kernels.linear(x.astype(mx.bfloat16), wb)), wb.nbytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,64")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--shapes", default="2048x2048,8192x2048,2048x8192")
    args = parser.parse_args()
    assert blocks.available(), blocks.describe()
    print(f"{kernels.describe()}; {blocks.describe()}")
    rows = [int(r) for r in args.rows.split(",")]
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        made = forms(n, k)
        times: dict[tuple[str, int], list[float]] = {}
        xs = {r: mx.random.normal((r, k)) for r in rows}
        mx.eval(list(xs.values()))
        for _ in range(args.repeat):
            for name, (fn, _size) in made.items():
                for r in rows:
                    start = time.perf_counter()
                    mx.eval(fn(xs[r]))
                    times.setdefault((name, r), []).append(time.perf_counter() - start)
        print(f"\n{n} x {k}: GMAC/s (median of {args.repeat}) by rows of x")
        print(f"  {'form':34} {'bits':>5} " + " ".join(f"{r:>7}" for r in rows))
        for name, (_fn, size) in made.items():
            rates = [n * k * r / statistics.median(times[name, r]) / 1e9 for r in rows]
            print(f"  {name:34} {8 * size / (n * k):5.2f} " + " ".join(f"{v:7.1f}" for v in rates))


if __name__ == "__main__":
    main()
