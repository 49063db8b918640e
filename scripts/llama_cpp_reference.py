"""The llama.cpp side of ``scripts/check-against-llama-cpp``; runs in the llama-cpp-python venv.

Reads a JSON request from a file, answers with a ``.npz`` (``--out``):

``{"kind": "generate", "model": PATH, "prompts": [TEXT...], "n_predict": N, "n_ctx": N}``
    For each prompt: its token ids (``tokenize(add_bos=True, special=True)``, how a server
    encodes a prompt), then greedy decoding of ``n_predict`` tokens, one ``eval`` per token, with
    the logits of every position: ``tokens_<i>`` (prompt then generated ids) and ``logits_<i>``
    (one row per position: the row at position j predicts token j + 1). Float32 KV cache and no
    flash attention, so that llama.cpp computes in float32 throughout (its defaults round the cache
    to float16).  ``"ids": [[ID...]...]`` in place of ``"prompts"``: prompts as token ids, read as
    they are.

``{"kind": "score", "model": PATH, "tokens": [[ID...]...], "n_ctx": N, "from": [N...]}``
    For each list of token ids, read as they are (no BOS added), one ``eval`` per token from
    position ``from[i]`` on (the prompt before it in one ``eval``), as a server decodes:
    ``logits_<i>``, one row per position from ``from[i] - 1`` on.  Float32 KV cache, no flash
    attention, as for ``generate``; ``"threads"`` as there.

``{"kind": "tokenize", "model": PATH, "texts": [TEXT...]}``
    ``ids_<i>_<add_special>_<parse_special>`` for each text and the four flag combinations, with a
    vocabulary-only load.

Only ``llama_cpp`` and ``numpy`` are needed, so it runs outside the project's environment.
"""

from __future__ import annotations

import argparse
import json

import llama_cpp
import numpy as np

_F32 = 0  # GGML_TYPE_F32


def _generate(request: dict) -> dict[str, np.ndarray]:
    out = {}
    for i, prompt in enumerate(request.get("prompts") or request["ids"]):
        llm = llama_cpp.Llama(
            request["model"],
            n_ctx=request["n_ctx"],
            n_batch=512,
            n_threads=request.get("threads", 2),
            logits_all=True,
            flash_attn=False,
            type_k=_F32,
            type_v=_F32,
            verbose=False,
        )
        tokens = list(prompt) if "ids" in request else llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        llm.eval(tokens)
        for _ in range(request["n_predict"]):
            next_token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens.append(next_token)
            llm.eval([next_token])
        out[f"tokens_{i}"] = np.array(tokens, dtype=np.int64)
        out[f"logits_{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
        del llm
    return out


def _score(request: dict) -> dict[str, np.ndarray]:
    out = {}
    for i, (tokens, start) in enumerate(zip(request["tokens"], request["from"])):
        llm = llama_cpp.Llama(request["model"], n_ctx=request["n_ctx"], n_batch=512,
                              n_threads=request.get("threads", 2), logits_all=True, flash_attn=False,
                              type_k=_F32, type_v=_F32, verbose=False)
        llm.eval(tokens[:start])
        for token in tokens[start:]:
            llm.eval([token])
        out[f"logits_{i}"] = np.array(llm.scores[start - 1: llm.n_tokens], dtype=np.float32)
        del llm
    return out


def _tokenize(request: dict) -> dict[str, np.ndarray]:
    llm = llama_cpp.Llama(request["model"], vocab_only=True, verbose=False)
    out = {}
    for i, text in enumerate(request["texts"]):
        for add_special in (0, 1):
            for parse_special in (0, 1):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=bool(add_special), special=bool(parse_special))
                out[f"ids_{i}_{add_special}_{parse_special}"] = np.array(ids, dtype=np.int64)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("request", help="a JSON file holding the request")
    parser.add_argument("--out", required=True, help="where to write the .npz answer")
    args = parser.parse_args()
    with open(args.request, encoding="utf-8") as f:
        request = json.load(f)
    answer = {"generate": _generate, "score": _score, "tokenize": _tokenize}[request["kind"]](request)
    np.savez(args.out, **answer)


if __name__ == "__main__":
    main()
