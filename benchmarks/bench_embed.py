"""Embedding throughput side by side: sentences per second through turbospark against the same
MLX encoder run directly, at batch sizes 1, 8 and 64, in one run.

For each size B, with B distinct sentences of about 15 tokens (a fresh set every run):

- direct: ``BertEncoder.tokenize`` + ``embed`` of the B sentences in this process (one forward
  pass), as a program using the model without a server would;
- one request: ``POST /v1/embeddings`` with the B sentences as its input (``encoding_format``
  base64, as the openai SDK asks by default);
- B requests: B concurrent single-sentence requests, which the server batches across requests
  (reported with the number of forward passes they took).

Sentences per second = B / wall time (client-side for the server, HTTP and JSON included).
``--sweep`` adds the direct path alone at more batch sizes (what one forward pass of that many
inputs gives: how ``embedding_batch``, the inputs a pass may take, was chosen).
Medians over ``--runs``; after a warm-up, the direct and server measurements alternate run by
run, so whatever else the machine does weighs on both.  The server's vectors are checked against
the direct ones.  Both sides use OpenBLAS where installed (this process re-executes itself with it
preloaded, as ``python -m turbospark serve`` does).

    python benchmarks/bench_embed.py [--model all-minilm-l6-v2] [--sizes 1,8,64] [--runs 5]
                                     [--sweep 16,32,64,128,256] [--json]
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ADJECTIVES = ("quiet", "bright", "ancient", "curious", "heavy", "gentle", "rapid", "hidden")
NOUNS = ("river", "engine", "library", "garden", "signal", "harbour", "mountain", "kitchen")
VERBS = ("crosses", "follows", "repairs", "paints", "measures", "guards", "feeds", "opens")


def sentences(count: int, salt: int) -> list[str]:
    """``count`` distinct sentences of about 15 tokens."""
    out = []
    for i in range(count):
        k = i + 97 * salt
        a, n, v, m = (ADJECTIVES[k % 8], NOUNS[(k // 8) % 8], VERBS[(k // 64) % 8], NOUNS[(k // 3) % 8])
        out.append(f"The {a} {n} {v} the {m} near house number {k} every morning.")
    return out


class Server:
    """``python -m turbospark serve --model scripted --embedding-model MODEL`` in a child process."""

    def __init__(self, model: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turbospark", "serve", "--model", "scripted",
             "--embedding-model", model, "--port", "0"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if m := re.match(r"turbospark listening on (\S+)", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit("the server did not start")

    def passes(self) -> float:
        import httpx

        text = httpx.get(f"{self.url}/metrics").text
        found = re.search(r"^turbospark_embedding_batch_inputs_count (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def decode(data: list[dict[str, Any]]) -> np.ndarray:
    return np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])


async def one_request(client: Any, url: str, texts: list[str]) -> np.ndarray:
    r = await client.post(f"{url}/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    r.raise_for_status()
    return decode(r.json()["data"])


async def many_requests(client: Any, url: str, texts: list[str]) -> np.ndarray:
    import trio

    out: list[np.ndarray] = [np.empty(0)] * len(texts)

    async def one(i: int) -> None:
        out[i] = (await one_request(client, url, [texts[i]]))[0]

    async with trio.open_nursery() as nursery:
        for i in range(len(texts)):
            nursery.start_soon(one, i)
    return np.array(out)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import trio

    from turbospark.cli.attach import stored_model
    from turbospark.cli.blas import describe
    from turbospark.model.bert import BertEncoder

    path, model_id = stored_model(args.model, kind="embedding")
    encoder = BertEncoder(path, model_id=model_id)
    server = Server(args.model)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[int, dict[str, list[float]]] = {b: {"direct": [], "one": [], "many": [], "passes": []} for b in sizes}
    worst = 0.0

    async def run_server(texts: list[str], many: bool) -> tuple[float, np.ndarray]:
        limits = httpx.Limits(max_connections=len(texts) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            got = await (many_requests if many else one_request)(client, server.url, texts)
            return time.perf_counter() - t0, got

    try:
        for run in range(-1, args.runs):  # run -1: warm-up, not recorded
            for b in sizes:
                texts = sentences(b, salt=run + 1000 * b)
                t0 = time.perf_counter()
                direct = encoder.embed(encoder.tokenize(texts, truncate=True))
                t_direct = time.perf_counter() - t0
                t_one, one = trio.run(run_server, texts, False)
                before = server.passes()
                t_many, many = trio.run(run_server, texts, True)
                passes = server.passes() - before
                worst = max(worst, float(np.abs(one - direct).max()), float(np.abs(many - direct).max()))
                if run >= 0:
                    rows[b]["direct"].append(b / t_direct)
                    rows[b]["one"].append(b / t_one)
                    rows[b]["many"].append(b / t_many)
                    rows[b]["passes"].append(passes)
    finally:
        server.close()
    table = {
        b: {key: statistics.median(values) for key, values in r.items()} for b, r in rows.items()
    }
    sweep: dict[int, float] = {}
    for b in [int(s) for s in args.sweep.split(",") if s]:
        samples = []
        for run in range(-1, args.runs):
            texts = sentences(b, salt=run + 7000 * b)
            t0 = time.perf_counter()
            encoder.embed(encoder.tokenize(texts, truncate=True))
            if run >= 0:
                samples.append(b / (time.perf_counter() - t0))
        sweep[b] = statistics.median(samples)
    return {
        "model": model_id, "blas": describe(), "runs": args.runs, "max_abs_diff": worst,
        "sizes": table, "sweep": sweep,
    }


def report(result: dict[str, Any]) -> None:
    print(f"{result['model']}, {result['blas']}; medians of {result['runs']} runs; "
          f"largest |server - direct| over all vectors: {result['max_abs_diff']:.2e}")
    print()
    print("| batch | direct sent/s | one request sent/s | server/direct | B requests at once sent/s | server/direct | forward passes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, row in result["sizes"].items():
        print(
            f"| {b} | {row['direct']:.1f} | {row['one']:.1f} | {row['one'] / row['direct']:.2f} | "
            f"{row['many']:.1f} | {row['many'] / row['direct']:.2f} | {row['passes']:.0f} |"
        )
    if result["sweep"]:
        print()
        print("direct, one forward pass: " + ", ".join(f"{b}: {v:.1f} sent/s" for b, v in result["sweep"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--sizes", default="1,8,64")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sweep", default="", help="batch sizes to time on the direct path alone")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    from turbospark.cli.blas import reexec_with_openblas

    reexec_with_openblas([sys.executable, __file__, *sys.argv[1:]])
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
