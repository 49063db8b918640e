"""Run on every rank by ``mlx.launch`` (``test_pipeline.py``): for each model directory named
on the command line, the logits of a prompt read in two chunks and of three decode steps, from
the whole model and from this rank's pipeline slice; rank 0 prints, per model, the largest
difference and the slice each rank held, as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from turbospark.model.mlx_ggml import load_model
from turbospark.model.pipeline import pipeline

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # longer than the tiny Gemma 3's window (8)


def logits(model) -> mx.array:  # type: ignore[no-untyped-def]
    cache = make_prompt_cache(model)
    out = [model(mx.array([PROMPT[:7]]), cache=cache), model(mx.array([PROMPT[7:]]), cache=cache)]
    for token in (20, 21, 22):
        out.append(model(mx.array([[token]]), cache=cache))
    return mx.concatenate(out, axis=1).astype(mx.float32)


def main() -> None:
    group = mx.distributed.init()
    report = {}
    for directory in map(Path, sys.argv[1:]):
        whole, _ = load_model(directory)
        expected = logits(whole)
        part, _ = load_model(directory, lazy=True)
        held = pipeline(part, group)
        mx.eval(part.parameters())
        got = logits(part)
        slices = mx.distributed.all_gather(mx.array([held]), group=group).tolist()
        report[directory.name] = {"diff": mx.abs(got - expected).max().item(), "shape": got.shape,
                                  "slices": slices}
    if group.rank() == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
