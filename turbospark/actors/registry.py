"""Which attached model answers a request (sans-io).

Policy, matching the original server's clients' expectations:
1. Only models with the wanted capability count.
2. An exact id or alias of a capable model selects it.
3. No capable model: ``NoModel`` (503).
4. Exactly one capable model: it answers whatever name was asked (SDKs and agent frameworks send
   their own default model names).
5. Otherwise: ``ModelNotFound`` (404) naming what is attached.
Detail lookups (``GET /v1/models/{id}``) match exactly, without the single-model fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from ..errors import ModelNotFound, NoModel

__all__ = ["Capability", "ModelEntry", "Registry", "alias_for"]

Capability = Literal["chat", "completion", "embedding"]


def alias_for(model_id: str) -> str:
    """The Anthropic-style alias every generative model also answers to."""
    return f"claude-turbospark-{model_id}"


@attrs.frozen
class ModelEntry:
    id: str
    context_window: int
    capabilities: frozenset[Capability]
    aliases: tuple[str, ...] = ()
    created: int = 0
    sampling_defaults: dict[str, float] = attrs.field(factory=dict, hash=False)
    fingerprint: str = ""  # OpenAI's system_fingerprint for what this model generates
    dimensions: int | None = None  # an embedding model's vector width
    #: A generative model's tokenizer and chat template (thread-safe), for counting a prompt's
    #: tokens without the model thread (``/v1/messages/count_tokens``).
    tokenizer: Any = attrs.field(default=None, eq=False, hash=False, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


@attrs.frozen
class Registry:
    entries: tuple[ModelEntry, ...] = ()

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for entry in self.entries:
            for name in entry.names:
                if name in seen:
                    raise ValueError(f"two attached models answer to the name '{name}'")
                seen.add(name)

    def public_names(self) -> list[str]:
        return [name for entry in self.entries for name in entry.names]

    def lookup(self, name: str) -> ModelEntry | None:
        """Exact id or alias, no fallback."""
        for entry in self.entries:
            if name in entry.names:
                return entry
        return None

    def resolve(self, name: str | None, want: Capability = "chat") -> ModelEntry:
        capable: Sequence[ModelEntry] = [e for e in self.entries if want in e.capabilities]
        if name:
            for entry in capable:
                if name in entry.names:
                    return entry
        if not capable:
            raise NoModel()
        if len(capable) == 1:
            return capable[0]
        raise ModelNotFound(name or "", [e.id for e in capable])
