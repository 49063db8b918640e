"""``serve --kv-cache q8_0`` on the default model as the CPU serves it (decision 0047): eight long
prompts at once hold at most 0.65x the KV bytes that float16 holds, and change float16's answers
no more than float16 changes float32's;
the startup line, ``/slots``, the fingerprint and the memory budget's bytes per token say which
type."""

from __future__ import annotations

from pathlib import Path

import pytest

from turbospark.kernels import ops as kernels
from turbospark.model.backend import SamplingParams

from .realmodels import smollm2_native_store

pytestmark = [pytest.mark.mlx, pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}"),
              pytest.mark.usefixtures("fast_ops_restored")]
TEXT = (Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "likelihood-text.md").read_text()
QUESTIONS = ["Which command installs and serves? Answer with the command.", "Which port does the client use?",
             "What is the default embedding model?", "How many dimensions do its embeddings have?",
             "Which Python version does it need?", "Which BLAS does it preload?",
             "What does scripts/setup create?", "How long does building the kernels take?"]


def _run(kind: str) -> tuple[list[list[int]], int, object]:
    from turbospark.model.mlx_backend import MlxBackend

    before = kernels.kv_cache()
    kernels.set_kv_cache(kind)
    try:
        stored = smollm2_native_store()
        backend = MlxBackend(stored.path, model_id=stored.name)
        for i, question in enumerate(QUESTIONS):
            prompt = backend.tokenizer.encode_chat([{"role": "user", "content": f"{TEXT[:2400]}\n\n{question}"}])
            backend.insert(i, prompt, SamplingParams(max_tokens=16, temperature=0.0, speculative=False))
        answers: list[list[int]] = [[] for _ in QUESTIONS]
        peak = 0
        while min(len(a) for a in answers) < 8:
            out = backend.step()
            peak = max(peak, backend.kv_bytes())
            for seq, token in out.tokens.items():
                answers[seq].append(token)
        backend.remove(0)  # into the prefix cache: /slots lists its bytes
        return [a[:8] for a in answers], peak, backend
    finally:
        kernels.set_kv_cache(before)


def _agreeing(x: list[list[int]], y: list[list[int]]) -> int:
    """Tokens two sets of answers share, each answer up to its first difference."""
    return sum(next((i for i, (p, q) in enumerate(zip(u, v)) if p != q), len(u)) for u, v in zip(x, y))


def test_eight_long_prompts_hold_at_most_0_65x_the_bytes_and_answer_as_float16_does() -> None:
    """Greedy answers of a 135M model are chaotic: float16 itself (the default) changes some of
    float32's, a near-tie flipped; q8_0 changes float16's no more than that."""
    exact, _, _ = _run("f32")
    half, half_bytes, half_backend = _run("f16")
    blocks, block_bytes, backend = _run("q8_0")
    assert len(half_backend.tokenizer.encode(TEXT[:2400])) > 500  # long prompts: the cache dominates
    assert block_bytes <= 0.65 * half_bytes, (block_bytes, half_bytes)
    assert [a[0] for a in blocks] == [a[0] for a in half]  # every answer begins alike
    assert _agreeing(blocks, half) >= _agreeing(half, exact) - 4, (blocks, half, exact)
    assert "their KV cache in q8_0 blocks" in backend.kernels and "in float16" in half_backend.kernels
    assert backend.fingerprint != half_backend.fingerprint  # a prompt cache on disk is kept per type
    assert backend.kv_estimate(1000) / half_backend.kv_estimate(1000) == pytest.approx(34 / 64, abs=0.01)
    assert "KV cache 12.2 MB per 1,000 tokens" in backend.kernels  # the startup line's real bytes
    slots = [backend.slot_command("list", None, None)[0], half_backend.slot_command("list", None, None)[0]]
    assert slots[0]["n_tokens"] == slots[1]["n_tokens"] > 500
    assert slots[0]["kv_bytes"] / slots[1]["kv_bytes"] == pytest.approx(34 / 64, abs=0.02)
