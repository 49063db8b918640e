"""Image generation on the CPU: seconds per denoising step and per image, and the memory it takes,
at 256x256 and 512x512, on two Z-Image pipelines of random weights written by Diffusers.

- ``tiny``: the tests' pipeline (a 2-layer transformer of width 64), held in float32;
- ``z-image``: Z-Image-Turbo's real widths (a transformer of width 3840, 30 heads, captions of
  2560 features; a Qwen3-4B text encoder, width 2560; the VAE whole, channels 128-512) with only
  2 transformer layers (of 30), 1 refiner pair (of 2) and 2 text encoder layers run (of 35),
  stored in bfloat16 as the real one ships and held in bfloat16 as a pipeline of its size is on
  the CPU (its products run in float32, ``turbospark/images/widen.py``); ``z-image-f32`` is the
  same files held in float32, what widening costs against weights that need none.

Each configuration and size runs in its own process (OpenBLAS preloaded, as ``serve`` does), as
the server runs it (``ZImagePipeline.generate``): the text encoder, ``--steps`` steps, the VAE's
decode, timed between the calls it makes to ``check()``; medians over ``--runs`` runs after one
warm-up.  For the real widths the run is repeated with one transformer layer and one encoder
layer fewer: the difference is one layer's cost, and the whole model is estimated as the measured
run plus the missing layers (the missing refiner pair counted as one more transformer layer, which
costs more: it sees only the image's tokens or the caption's).  Memory: each process's peak RSS;
for the whole model, that plus the bytes of the missing layers in the dtype it is held in.
Z-Image-Turbo's default run is 9 steps.

    python benchmarks/bench_images.py [--runs 3] [--steps 3] [--sizes 256 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _rss import peak_rss_mb  # the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a lighthouse on a cliff at dusk, waves breaking below, oil painting"
IMAGE_STEPS = 9
#: Z-Image-Turbo's transformer and text encoder, as its config files give them
REAL_LAYERS, REAL_REFINERS, REAL_ENCODER_RUN = 30, 2, 35
REAL_VOCAB = 151936
REAL = {
    "transformer": {"dim": 3840, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 30, "n_kv_heads": 30,
                    "cap_feat_dim": 2560, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512]},
    "encoder": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 3, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960},
    "vae": {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4},
}  # fmt: skip
CONFIGS = {"tiny": ("tiny", "float32"), "z-image": ("real", "bfloat16"), "z-image-f32": ("real", "float32")}


def build(home: Path, kind: str) -> Path:
    directory = home / kind
    if not (directory / "model_index.json").exists():
        sys.path.insert(0, str(ROOT))
        from tests.image_pipelines import tiny_zimage

        sizes = REAL if kind == "real" else {}
        tiny_zimage(directory, **sizes, stored="bfloat16" if kind == "real" else "float32")
    return directory


def _bytes(module: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def timed_run(pipe: Any, size: int, steps: int, seed: int) -> dict[str, float]:
    from turbospark.images.pipeline import GenerateArgs

    marks: list[float] = []
    start = time.perf_counter()
    pipe.generate(GenerateArgs(PROMPT, size, size, steps=steps, seed=seed), lambda: marks.append(time.perf_counter()))
    end = time.perf_counter()
    # check() runs before the encoder, before each step and before the decode
    return {"encode": marks[1] - marks[0], "step": statistics.median(b - a for a, b in zip(marks[1:-1], marks[2:])),
            "decode": end - marks[-1], "total": end - start}  # fmt: skip


def _evaluated(mx: Any, array: Any) -> Any:
    mx.eval(array)
    return array


def child(directory: Path, dtype: str, real: bool, size: int, steps: int, runs: int) -> None:
    import mlx.core as mx

    from turbospark.images.pipeline import ZImagePipeline

    pipe = ZImagePipeline(directory, "bench", getattr(mx, dtype))
    encode = pipe.encoder.encode
    pipe.encoder.encode = lambda prompt: _evaluated(mx, encode(prompt))  # its own time, not the first step's
    timed_run(pipe, size, 1, 0)  # warm-up
    samples = [timed_run(pipe, size, steps, seed) for seed in range(runs)]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    out["weights_mb"] = (_bytes(pipe.transformer) + _bytes(pipe.encoder.model) + _bytes(pipe.vae)) / 1e6
    if real:
        dit, encoder = pipe.transformer, pipe.encoder.model
        layer, enc_layer = _bytes(dit.layers[0]), _bytes(encoder.layers[0])
        refiners = _bytes(dit.noise_refiner[0]) + _bytes(dit.context_refiner[0])
        embed_row = encoder.embed_tokens.weight.nbytes / encoder.embed_tokens.weight.shape[0]
        missing = ((REAL_LAYERS - len(dit.layers)) * layer + (REAL_REFINERS - len(dit.noise_refiner)) * refiners
                   + (REAL_ENCODER_RUN - len(encoder.layers)) * enc_layer
                   + (REAL_VOCAB - encoder.embed_tokens.weight.shape[0]) * embed_row)  # fmt: skip
        full_layers, full_encoder = dit.layers, encoder.layers
        dit.layers, encoder.layers = full_layers[:-1], full_encoder[:-1]
        decode, pipe._decode = pipe._decode, lambda latents: []  # only the encoder's and the steps' times are read
        fewer = [timed_run(pipe, size, steps, seed) for seed in range(runs)]
        dit.layers, encoder.layers, pipe._decode = full_layers, full_encoder, decode
        d_step = out["step"] - statistics.median(s["step"] for s in fewer)
        d_encode = out["encode"] - statistics.median(s["encode"] for s in fewer)
        extra = (REAL_LAYERS - len(full_layers)) + (REAL_REFINERS - len(dit.noise_refiner))
        out["full_step"] = out["step"] + extra * d_step
        out["full_encode"] = out["encode"] + (REAL_ENCODER_RUN - len(full_encoder)) * d_encode
        out["full_weights_mb"] = out["weights_mb"] + missing / 1e6
        out["missing_mb"] = missing / 1e6
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps a run (their median is the step's time)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "bench_images")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dtype, args.real, args.size, args.steps, args.runs)

    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in args.configs:
        kind, dtype = CONFIGS[name]
        directory = build(args.home, kind)
        for size in args.sizes:
            command = [sys.executable, "-m", "turbospark.cli.blas", sys.executable, __file__, "--child", str(directory),
                       "--dtype", dtype, "--size", str(size), "--steps", str(args.steps), "--runs", str(args.runs),
                       *(["--real"] if kind == "real" else [])]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
            if done.returncode:
                raise SystemExit(f"{name} at {size}: {done.stderr[-2000:]}")
            results.setdefault(name, {})[size] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"Medians of {args.runs} runs of {args.steps} steps after a warm-up; an image is the encoder, "
          f"{IMAGE_STEPS} steps and the decode\n")
    print("| pipeline | held as | size | encoder s | a step s | decode s | an image s | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, by_size in results.items():
        dtype = CONFIGS[name][1]
        for size, r in by_size.items():
            image = r["encode"] + IMAGE_STEPS * r["step"] + r["decode"]
            label = f"{name} (2 of 30 layers)" if "full_step" in r else name
            print(f"| {label} | {dtype} | {size} | {r['encode']:.2f} | {r['step']:.2f} | {r['decode']:.2f} | "
                  f"{image:.1f} | {r['peak_rss_mb']:.0f} |")
            if "full_step" in r:
                image = r["full_encode"] + IMAGE_STEPS * r["full_step"] + r["decode"]
                print(f"| {name}, all layers (estimated) | {dtype} | {size} | {r['full_encode']:.2f} | "
                      f"{r['full_step']:.1f} | {r['decode']:.2f} | {image:.0f} | "
                      f"{r['peak_rss_mb'] + r['missing_mb']:.0f} |")


if __name__ == "__main__":
    main()
