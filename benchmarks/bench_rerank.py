"""Rerank throughput side by side: (query, document) pairs per second through turbospark's
``/v1/rerank`` against the same MLX encoder run directly, at 1, 8 and 64 documents, in one run.

For each size D, with D distinct documents of about 15 tokens and one query (fresh every run):

- direct: the encoder's own tokenize + forward pass of the D pairs in this process (a
  cross-encoder reads each pair; an embedding model embeds the query and the documents and
  takes cosine similarities), as a program using the model without a server would;
- one request: ``POST /v1/rerank`` with the D documents;
- 8 requests: eight such requests at once, which the server batches across requests.

Pairs per second = pairs / wall time (client-side for the server, HTTP and JSON included);
medians over ``--runs``, direct and server alternating run by run.  The server's scores are
checked against the direct ones.

``--model`` names a stored model (default all-MiniLM-L6-v2, which reranks by cosine).  No
cross-encoder's weights ship on PyPI, so ``--cross-encoder`` builds one with random weights in
ms-marco-MiniLM-L-6-v2's shape (6 layers, 384 wide, 12 heads, all-MiniLM's tokenizer) in a
temporary store: the same work per pair as the real one.

    python benchmarks/bench_rerank.py [--model all-minilm-l6-v2 | --cross-encoder] [--sizes 1,8,64]
                                      [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import Child  # noqa: E402
from bench_embed import sentences  # noqa: E402

QUERY = "Which engine repairs the river library every morning?"


def build_cross_encoder(home: Path) -> str:
    """A random-weight BertForSequenceClassification in ms-marco-MiniLM-L-6-v2's shape, imported
    into the store at ``home``; its name there."""
    import mlx.core as mx

    from turbospark.cli.attach import stored_model
    from turbospark.store.store import ModelStore

    minilm, _ = stored_model("all-minilm-l6-v2", kind="embedding")
    src = home / "src"
    src.mkdir(parents=True)
    h, layers, ff, rng = 384, 6, 1536, np.random.default_rng(0)
    w: dict[str, Any] = {}

    def add(name: str, *shape: int, scale: float = 0.05) -> None:
        w[name] = mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    for name, rows in (("word", 30522), ("position", 512), ("token_type", 2)):
        add(f"bert.embeddings.{name}_embeddings.weight", rows, h)
    norms = ["bert.embeddings.LayerNorm"] + [
        f"bert.encoder.layer.{i}.{p}" for i in range(layers) for p in ("attention.output.LayerNorm", "output.LayerNorm")
    ]
    for name in norms:
        w[name + ".weight"], w[name + ".bias"] = mx.ones((h,)), mx.zeros((h,))
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            add(p + m + ".weight", h, h)
            add(p + m + ".bias", h)
        add(p + "intermediate.dense.weight", ff, h)
        add(p + "intermediate.dense.bias", ff)
        add(p + "output.dense.weight", h, ff)
        add(p + "output.dense.bias", h)
    add("bert.pooler.dense.weight", h, h)
    add("bert.pooler.dense.bias", h)
    add("classifier.weight", 1, h)
    add("classifier.bias", 1)
    mx.save_safetensors(str(src / "model.safetensors"), w)
    config = json.loads((minilm / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (src / "config.json").write_text(json.dumps(config))
    shutil.copy2(minilm / "tokenizer.json", src / "tokenizer.json")
    ModelStore(home / "models").import_source(src, name="random-cross-encoder", progress=False)
    return "random-cross-encoder"


def direct_scores(encoder: Any, docs: list[str]) -> np.ndarray:
    if encoder.cross:
        return encoder.embed(encoder.tokenize_pairs(QUERY, docs, truncate=True))[:, 0]
    vectors = encoder.embed(encoder.tokenize([QUERY, *docs], truncate=True))
    return vectors[1:] @ vectors[0]


async def rerank(client: Any, url: str, model: str, docs: list[str]) -> np.ndarray:
    r = await client.post(f"{url}/v1/rerank", json={"model": model, "query": QUERY, "documents": docs})
    r.raise_for_status()
    scores = np.zeros(len(docs), np.float32)
    for res in r.json()["results"]:
        scores[res["index"]] = res["relevance_score"]
    return scores


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import trio

    from turbospark.cli.attach import stored_model
    from turbospark.cli.blas import describe
    from turbospark.model.bert import BertEncoder

    path, model_id = stored_model(args.model, kind="embedding")
    encoder = BertEncoder(path, model_id=model_id)
    server = Child(["--model", "scripted", "--embedding-model", args.model])
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[int, dict[str, list[float]]] = {d: {"direct": [], "one": [], "eight": []} for d in sizes}
    worst = 0.0

    async def served(docs: list[str], copies: int) -> tuple[float, list[np.ndarray]]:
        out: list[np.ndarray] = []
        async with httpx.AsyncClient(timeout=600) as client:

            async def one() -> None:
                out.append(await rerank(client, server.url, model_id, docs))

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(copies):
                    nursery.start_soon(one)
            return time.perf_counter() - t0, out

    try:
        for run in range(-1, args.runs):  # run -1: warm-up, not recorded
            for d in sizes:
                docs = sentences(d, salt=run + 1000 * d)
                t0 = time.perf_counter()
                direct = direct_scores(encoder, docs)
                t_direct = time.perf_counter() - t0
                t_one, one = trio.run(served, docs, 1)
                t_eight, eight = trio.run(served, docs, 8)
                worst = max(worst, *(float(np.abs(s - direct).max()) for s in one + eight))
                if run >= 0:
                    rows[d]["direct"].append(d / t_direct)
                    rows[d]["one"].append(d / t_one)
                    rows[d]["eight"].append(8 * d / t_eight)
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)
    table = {d: {k: statistics.median(v) for k, v in r.items()} for d, r in rows.items()}
    how = "cross-encoder" if encoder.cross else "cosine similarity of embeddings"
    return {"model": model_id, "scoring": how, "blas": describe(), "runs": args.runs, "max_abs_diff": worst, "sizes": table}


def report(result: dict[str, Any]) -> None:
    print(f"{result['model']} ({result['scoring']}), {result['blas']}; medians of {result['runs']} runs; "
          f"largest |server - direct| score: {result['max_abs_diff']:.2e}")
    print()
    print("| documents | direct pairs/s | one request pairs/s | server/direct | 8 requests at once pairs/s | server/direct |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d, row in result["sizes"].items():
        print(f"| {d} | {row['direct']:.1f} | {row['one']:.1f} | {row['one'] / row['direct']:.2f} | "
              f"{row['eight']:.1f} | {row['eight'] / row['direct']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--cross-encoder", action="store_true", help="a random-weight MiniLM-L6 cross-encoder")
    parser.add_argument("--sizes", default="1,8,64")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    from turbospark.cli.blas import reexec_with_openblas

    reexec_with_openblas([sys.executable, __file__, *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        if args.cross_encoder:
            args.model = build_cross_encoder(Path(tmp))
            os.environ["TURBOSPARK_HOME"] = tmp  # the child reads it there
        result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
