"""A thinking budget as a hard cap (Anthropic's ``thinking.budget_tokens``, vLLM's
``thinking_token_budget``, ``serve --reasoning-budget``): past the budget inside ``<think>``,
``</think>`` is the only token the model may take, and it answers after it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark.model.backend import SamplingParams
from turbospark.model.mlx_sampling import make_processors, think_budget, think_ids

START, END = 5, 6


def _forced(process, context: list[int]) -> int | None:
    logits = process(mx.array(context), mx.zeros((1, 10)))
    allowed = np.flatnonzero(np.isfinite(np.array(logits)[0]))
    return int(allowed[0]) if len(allowed) == 1 else None


def test_past_the_budget_the_end_of_thinking_is_the_only_token() -> None:
    process = think_budget(3, START, END)
    prompt = [1, 2, START]  # the prompt opened the reasoning
    assert _forced(process, prompt) is None
    assert _forced(process, [*prompt, 7, 8]) is None
    assert _forced(process, [*prompt, 7, 8, 9]) == END  # three tokens of reasoning: close it
    assert _forced(process, [*prompt, 7, 8, 9, END, 4]) is None  # closed: the answer runs free
    # a speculative step's positions, then its rewind: read again from the start
    assert _forced(process, [*prompt, 7]) is None
    assert _forced(process, [*prompt, 7, 8, 9, 9]) == END
    # a rewind to the same length: a drafted </think> refused, the reasoning still open
    rewound = think_budget(3, START, END)
    assert _forced(rewound, [*prompt, 9, END]) is None
    assert _forced(rewound, [*prompt, 9, 8]) is None
    assert _forced(rewound, [*prompt, 9, 8, 7]) == END
    # reasoning the model opens itself counts from its <think>
    own = think_budget(2, START, END)
    assert _forced(own, [1, 2]) is None and _forced(own, [1, 2, 3, START, 7]) is None
    assert _forced(own, [1, 2, 3, START, 7, 8]) == END


def test_only_a_vocabulary_with_both_markers_and_a_request_with_a_budget_get_one() -> None:
    assert think_ids({"<think>": 5, "</think>": 6, "a": 1}) == (5, 6)
    assert think_ids({"<think>": 5}) is None
    assert len(make_processors(SamplingParams(reasoning_budget=4), 3, think=(5, 6))) == 1
    assert make_processors(SamplingParams(reasoning_budget=4), 3, think=None) == []
    assert make_processors(SamplingParams(), 3, think=(5, 6)) == []


def test_the_families_budgets_reach_the_sampling_parameters() -> None:
    from turbospark.routes._openai import sampling_params as openai_params
    from turbospark.routes.anthropic_request import plan, sampling_params
    from turbospark.wire.anthropic import MessagesRequest
    from turbospark.wire.codec import structure
    from turbospark.wire.openai import ChatCompletionRequest

    body = structure({"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}],
                      "thinking": {"type": "enabled", "budget_tokens": 1024}}, MessagesRequest)
    p = plan(body, None, False, False)
    assert sampling_params(body, p, defaults={}, max_tokens=2048).reasoning_budget == 1024
    assert "thinking.budget_tokens" not in p.labels  # enforced, no longer a degradation
    chat = structure({"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 64},
                     ChatCompletionRequest)
    assert openai_params(chat, max_tokens=None, model_defaults={}).reasoning_budget == 64


@pytest.mark.mlx
def test_a_real_model_closes_its_reasoning_at_the_budget(monkeypatch) -> None:
    """SmolLM2 has no ``<think>``: two of its own tokens stand for the markers."""
    from turbospark.model import mlx_backend
    from turbospark.model.mlx_backend import MlxBackend

    from .realmodels import smollm2_store

    backend = MlxBackend(smollm2_store().path, model_id="m")
    opening, closing = backend.tokenizer.encode(" Hmm")[0], backend.tokenizer.encode(" Done")[0]
    monkeypatch.setattr(mlx_backend, "think_ids", lambda vocab: (opening, closing))
    prompt = [*backend.tokenizer.encode("Let me think about the sea."), opening]
    for budget, speculative in ((4, False), (6, True)):
        backend.insert(0, prompt, SamplingParams(max_tokens=12, temperature=0.0, reasoning_budget=budget,
                                                 speculative=speculative))
        out: list[int] = []
        while len(out) < 10:
            step = backend.step()
            out += [step.tokens[0], *step.more.get(0, ())] if 0 in step.tokens else []
        backend.remove(0, keep_cache=False)
        assert out[budget] == closing and closing not in out[:budget], (budget, out)
