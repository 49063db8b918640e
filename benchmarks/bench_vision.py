"""Images on the CPU: what one image costs its request, and what image requests joining cost the
streams already decoding, on a model of SmolVLM-256M's shape.

The model: SmolLM2-135M-Instruct's real weights (pulled from its package, as ``serve`` pulls it)
as the language model, and a SigLIP tower at SmolVLM-256M's widths (768 wide, 12 layers, 512-pixel
tiles in 16-pixel patches, 64 tokens a tile after the 4x4 pixel shuffle) with random weights,
written by transformers (torch's CPU build) and imported with ``models import``.  By default an
image is one tile (``--split`` lets the processor cut it into SmolVLM's grid of tiles as well).

1. One image: the time to first token of a chat with one image (a new image each run, so its
   features are never cached) against the same question without it; the difference is the image
   (its tiles through the tower, then its tokens' prefill).
2. Joins: 8 streams decode (``--max-tokens`` each); once each has a few tokens, ``--joiners``
   requests arrive: with one image each, or (another round) with a text prompt of about as many
   tokens.  Reported for each: the 8 streams' aggregate decode rate from the first arrival until
   every joiner has its first token, and the longest gap any of the 8 saw meanwhile (and the 95th
   percentile of their gaps), against their median gap before.

    python benchmarks/bench_vision.py [--runs 3] [--joiners 2] [--max-tokens 96] [--split] [--json]

Medians over ``--runs``; image and text rounds alternate, so whatever else the machine does weighs
on both alike.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_decode import stream_chat  # the scripts' folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-smolvlm"
STREAMS, FEW = 8, 6
SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "image_size": 512, "patch_size": 16}  # fmt: skip


def build(home: Path, split: bool) -> Path:
    """SmolVLM-256M's shape in ``home``, imported into its store; returns the source directory."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from safetensors.numpy import load_file

    from tests.vision_models import IDEFICS3_TEMPLATE, IMAGE_TOKENS
    from turbospark.store.pull import pull
    from turbospark.store.store import ModelStore

    src = home / "source"
    text = pull("smollm2-135m-instruct", ModelStore(home / "pulled"), progress=False, dtype="float32").path
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(text / "tokenizer.json"), bos_token="<|im_start|>",
                                               eos_token="<end_of_utterance>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text_config = json.loads((text / "config.json").read_text())
    text_config.update(vocab_size=len(tok), eos_token_id=[tok.eos_token_id, *text_config["eos_token_id"]],
                       tie_word_embeddings=False)  # the head is written out: one file for transformers
    config = transformers.Idefics3Config(text_config=text_config, vision_config=SIGLIP, scale_factor=4,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    weights = {k: torch.from_numpy(v) for k, v in load_file(str(text / "model.safetensors")).items()}
    with torch.no_grad():
        embed = model.model.text_model.embed_tokens.weight
        rows = weights.pop("model.embed_tokens.weight")
        embed[: rows.shape[0]] = rows  # the image tokens' rows stay random
        missing = model.model.text_model.load_state_dict(
            {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
        model.lm_head.weight.copy_(embed)  # SmolLM2 ties its output head
    model.save_pretrained(src)
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                                    do_image_splitting=split)
    transformers.Idefics3Processor(images, tok, image_seq_len=64, chat_template=IDEFICS3_TEMPLATE).save_pretrained(src)
    done = subprocess.run([sys.executable, "-m", "turbospark", "models", "import", str(src), "--name", MODEL],
                          env={**os.environ, "TURBOSPARK_HOME": str(home)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return src


def png(seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((384, 512, 1)) * 255 * np.linspace(0.3, 1, 3)).astype(np.uint8)  # a tinted noise photo
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def body(question: str, image: str | None, max_tokens: int) -> dict[str, Any]:
    content: Any = question if image is None else [{"type": "image_url", "image_url": {"url": image}},
                                                     {"type": "text", "text": question}]
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": content}]}


def timed(client: Any, url: str, request: dict[str, Any], stamps: list[float]) -> dict[str, Any]:
    return stream_chat(client, url, request, stamps)[0]


def ttft(client: Any, url: str, request: dict[str, Any]) -> tuple[float, int]:
    stamps: list[float] = []
    t0 = time.perf_counter()
    usage = timed(client, url, {**request, "max_tokens": 2}, stamps)
    return stamps[0] - t0, usage["prompt_tokens"]


def joins(client_for: Any, url: str, run: int, joiners: list[dict[str, Any]], max_tokens: int) -> dict[str, float]:
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    firsts: list[float] = []
    topics = ["a lighthouse", "a river", "a forest", "a city", "a harbour", "a desert", "a mountain", "a garden"]
    threads = [threading.Thread(target=timed, args=(client_for(), url, body(
        f"Run {run}, stream {i}: write a long story about {topics[i]}.", None, max_tokens), stamps[i]))
        for i in range(STREAMS)]  # fmt: skip
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < FEW:
        time.sleep(0.01)
    arrived = time.perf_counter()

    def join(request: dict[str, Any]) -> None:
        mine: list[float] = []
        timed(client_for(), url, {**request, "max_tokens": 1}, mine)
        firsts.append(mine[0])

    joined = [threading.Thread(target=join, args=(r,)) for r in joiners]
    for t in joined:
        t.start()
    for t in joined:
        t.join()
    until = max(firsts)
    for t in threads:
        t.join()
    before = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b < arrived]
    during = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if arrived <= b <= until]
    tokens = sum(1 for s in stamps for x in s if arrived <= x <= until)
    return {"join_s": until - arrived, "decode_tps": tokens / (until - arrived),
            "worst_gap_ms": 1000 * max(during or [0.0]), "p95_gap_ms": 1000 * _p95(during or [0.0]),
            "usual_gap_ms": 1000 * statistics.median(before)}


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--joiners", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--split", action="store_true", help="cut images into SmolVLM's grid of tiles")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        build(home, args.split)
        proc = subprocess.Popen([sys.executable, "-m", "turbospark", "serve", "--model", MODEL, "--port", "0"],
                                env={**os.environ, "TURBOSPARK_HOME": str(home)}, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("turbospark listening on "):
                url = line.split()[-1]
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        client = httpx.Client(timeout=600)
        try:
            question = "Describe this image in detail."
            ttft(client, url, body(question, png(999), 2))  # warm-up
            with_image, without, prompt = [], [], {}
            for run in range(args.runs):
                seconds, prompt["image"] = ttft(client, url, body(f"{question} ({run})", png(run), 2))
                with_image.append(seconds)
                seconds, prompt["text"] = ttft(client, url, body(f"{question} ({run})", None, 2))
                without.append(seconds)
            filler = " ".join(["and then the light changed over the water"] * (prompt["image"] // 9))
            rounds: dict[str, list[dict[str, float]]] = {"image": [], "text": []}
            for run in range(args.runs):
                rounds["image"].append(joins(lambda: httpx.Client(timeout=600), url, run, [
                    body(f"{question} ({run}, {j})", png(1000 + 10 * run + j), 1) for j in range(args.joiners)],
                    args.max_tokens))  # fmt: skip
                rounds["text"].append(joins(lambda: httpx.Client(timeout=600), url, run, [
                    body(f"{filler} ({run}, {j})", None, 1) for j in range(args.joiners)], args.max_tokens))
        finally:
            client.close()
            proc.terminate()
            proc.wait(timeout=30)
    result = {
        "image_prompt_tokens": prompt["image"], "text_prompt_tokens": prompt["text"],
        "ttft_image_s": statistics.median(with_image), "ttft_text_s": statistics.median(without),
        "joins": {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in rounds.items()},
    }
    result["image_s"] = result["ttft_image_s"] - result["ttft_text_s"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"one image ({prompt['image'] - prompt['text']} tokens more): TTFT {result['ttft_image_s']:.2f} s "
          f"against {result['ttft_text_s']:.2f} s without it ({result['image_s']:.2f} s for the image)")
    for kind, r in result["joins"].items():
        print(f"{args.joiners} {kind} joiners: {STREAMS} streams decode {r['decode_tps']:.1f} tok/s until they "
              f"have their first token ({r['join_s']:.2f} s); gaps: worst {r['worst_gap_ms']:.0f} ms, "
              f"95th percentile {r['p95_gap_ms']:.0f} ms (usual {r['usual_gap_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
