"""GGUFs of a real model's shape with random weights, quantized by llama.cpp itself, so that speed
can be measured at real sizes without downloading the real weights.

The tokenizer and its metadata (tokens, types, merges, special ids, chat template) come from the
catalogue's SmolLM2-135M-Instruct GGUF (benchmarks/_gguf.py; every SmolLM2 shares its 49152-token
vocabulary); the ``llama.*`` metadata and the tensors follow ``--shape``.  The matrices are F16
drawn from a normal distribution (std 0.02, seeded), the norms F32 ones; the embedding is tied, as
in SmolLM2.  The F16 file is written tensor by tensor (memory stays around the largest tensor's
size), then each ``--types`` form is made from it with the native ``llama-quantize``
(benchmarks/_llama_native.py, built the first time) and checked with one ``llama-bench`` run
(``-t 2 -p 64 -n 16``, pp64 and tg16 tok/s).  Files that exist are kept; the F16 one is deleted
afterwards unless ``--keep-f16``.

    python benchmarks/make_shaped_gguf.py [--shape smollm2-1.7b|smollm2-135m]
                                          [--types Q4_K_M Q4_0 Q8_0 Q5_K_M Q6_K] [--out DIR]
                                          [--keep-f16] [--no-bench]

Output: ``DIR/<shape>-<TYPE>.gguf``, DIR defaulting to ``$TURBOSPARK_HOME/sources/shaped``
(``~/.cache/turbospark/sources/shaped``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from _gguf import catalogue_gguf  # the scripts' folder is on sys.path
from _llama_native import native_llama_cpp

from turbospark.store.store import store_root


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's dimensions (``head_dim`` = ``hidden / heads``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    vocab: int = 49152
    context: int = 8192
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0),
    "smollm2-1.7b": Shape(hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192, rope_theta=130000.0),
}
TOKENIZER = "smollm2-135m-instruct"


def tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Name and numpy shape (rows = outputs) of every tensor, in the converters' order."""
    yield "token_embd.weight", (s.vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        yield f"blk.{i}.attn_norm.weight", (s.hidden,)
        yield f"blk.{i}.attn_q.weight", (q, s.hidden)
        yield f"blk.{i}.attn_k.weight", (kv, s.hidden)
        yield f"blk.{i}.attn_v.weight", (kv, s.hidden)
        yield f"blk.{i}.attn_output.weight", (s.hidden, q)
        yield f"blk.{i}.ffn_norm.weight", (s.hidden,)
        yield f"blk.{i}.ffn_gate.weight", (s.intermediate, s.hidden)
        yield f"blk.{i}.ffn_up.weight", (s.intermediate, s.hidden)
        yield f"blk.{i}.ffn_down.weight", (s.hidden, s.intermediate)
    yield "output_norm.weight", (s.hidden,)


def write_f16(path: Path, name: str, s: Shape, source: Path, seed: int = 0) -> None:
    """The F16 GGUF of shape ``s``, tokenizer from ``source``, one tensor in memory at a time."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(s.vocab)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if vtype is gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    shapes = list(tensors(s))
    for tensor, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(tensor, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor, shape in shapes:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        data = np.empty(shape, np.float16)
        for row in range(0, shape[0], 4096):  # float32 scratch of at most 4096 rows
            block = rng.standard_normal((min(4096, shape[0] - row), shape[1]), np.float32)
            block *= 0.02
            data[row : row + len(block)] = block
        writer.write_tensor_data(data)
        del data
    writer.close()


def bench(llama_bench: Path, model: Path) -> dict[str, tuple[float, float]]:
    """One ``llama-bench -t 2 -p 64 -n 16`` run (its default 5 repetitions): mean and standard
    deviation of tok/s by test (``pp64``, ``tg16``)."""
    command = [str(llama_bench), "-m", str(model), "-t", "2", "-p", "64", "-n", "16", "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return {("pp" if r["n_prompt"] else "tg") + str(r["n_prompt"] or r["n_gen"]): (r["avg_ts"], r["stddev_ts"])
            for r in json.loads(result.stdout)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q6_K"])
    parser.add_argument("--out", type=Path, default=None, help="default: the store's sources/shaped")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file the types are made from")
    parser.add_argument("--no-bench", action="store_true", help="skip the llama-bench check")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = catalogue_gguf(TOKENIZER)
    out = args.out or store_root().parent / "sources" / "shaped"
    out.mkdir(parents=True, exist_ok=True)
    native = native_llama_cpp()
    f16 = out / f"{args.shape}-F16.gguf"
    targets = {t: out / f"{args.shape}-{t}.gguf" for t in args.types}
    missing = {t: p for t, p in targets.items() if not p.is_file()}
    if missing and not f16.is_file():
        t0 = time.perf_counter()
        partial = f16.with_suffix(".gguf.partial")
        write_f16(partial, args.shape, SHAPES[args.shape], source, seed=args.seed)
        partial.rename(f16)
        print(f"{f16.name}: {f16.stat().st_size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s")
    for kind, path in missing.items():
        t0 = time.perf_counter()
        partial = path.with_suffix(".gguf.partial")
        done = subprocess.run([str(native.quantize), str(f16), str(partial), kind, "2"],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise SystemExit(f"llama-quantize {kind} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        partial.rename(path)
        print(f"{path.name}: quantized in {time.perf_counter() - t0:.0f} s")
    if f16.is_file() and not args.keep_f16:
        f16.unlink()
    print(native.build_info())
    for kind, path in targets.items():
        figures = {} if args.no_bench else bench(native.bench, path)
        text = "  ".join(f"{test} {mean:7.2f} ± {sd:5.2f} tok/s" for test, (mean, sd) in figures.items())
        print(f"{path}  {path.stat().st_size / 1e9:6.3f} GB  {text}".rstrip())


if __name__ == "__main__":
    main()
