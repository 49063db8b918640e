"""Draft-model speculation (``--draft-model``): a small model guesses, the served one checks.

Runs on the model thread, inside a speculative step (``mlx_backend._speculate``), in place of the
prompt-lookup index: ``ModelDrafter`` has ``Lookup``'s interface (``tokens``, ``extend``,
``draft``), so the step, ``verify`` and its exactness are the same.  Each sequence has its own
drafter, with its own KV cache of the draft model:

- ``extend`` adds the sequence's accepted tokens (the model thread's truth); nothing runs.
- ``draft(k)`` first brings the draft cache to those tokens: what it holds beyond their common
  prefix (draft tokens the served model refused) is trimmed away, what it lacks (the tokens
  accepted since, or the whole prompt the first time) is fed in one forward pass; then ``k``
  tokens are drafted greedily, one small forward pass each.  The last drafted token is not fed
  (its place is decided by the check).

A draft model must share the served model's vocabulary (the same token for every id): the pair
is refused when they differ, as mlx-lm's server refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

__all__ = ["ModelDrafter", "check_vocabularies"]


def check_vocabularies(served: dict[str, int], draft: dict[str, int], draft_id: str) -> None:
    """Refuse a draft model whose tokens are not the served model's, id for id."""
    if served == draft:
        return
    differ = sum(1 for token, i in served.items() if draft.get(token) != i)
    raise ValueError(
        f"the draft model '{draft_id}' does not share this model's vocabulary ({len(draft)} tokens against "
        f"{len(served)}; {differ} of this model's tokens differ there): a draft model must use the same tokenizer"
    )


class ModelDrafter:
    """One sequence's drafts from ``model`` (the draft model), on the model thread's stream."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens: list[int] = []  # the sequence's accepted tokens (and its pending one)
        self._fed: list[int] = []  # what the draft cache holds, in order
        self._cache: list[Any] = make_prompt_cache(model)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def draft(self, k: int) -> list[int]:
        if k <= 0 or not self.tokens:
            return []
        common = 0
        for fed, token in zip(self._fed, self.tokens):
            if fed != token:
                break
            common += 1
        if common == len(self.tokens):  # the cache must read at least the last token anew
            common -= 1
        if common < len(self._fed):
            if can_trim_prompt_cache(self._cache):
                trim_prompt_cache(self._cache, len(self._fed) - common)
                del self._fed[common:]
            else:  # a cache that cannot be cut: read the sequence again
                self._cache, self._fed, common = make_prompt_cache(self.model), [], 0
        out: list[int] = []
        step = self.tokens[common:]
        for _ in range(k):
            logits = self.model(mx.array([step], dtype=mx.uint32), cache=self._cache)
            self._fed.extend(step)
            token = int(mx.argmax(logits[0, -1]).item())
            out.append(token)
            step = [token]
        return out
