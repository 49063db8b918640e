"""Which known model answers a request, by name and capability (sans-io).

Owns ``ModelEntry`` (a model as the routes see it), ``Registry`` (an immutable set of entries in
which no name answers for two models) and the naming rules, written once here:

- ``Registry.resolve``, the OpenAI and Anthropic routes' policy, matching the original server's
  clients' expectations:
  1. Only models with the wanted capability count.
  2. An exact id or alias of a capable model selects it.
  3. No capable model: ``NoModel`` (503).
  4. Exactly one capable model: it answers whatever name was asked (SDKs and agent frameworks
     send their own default model names).
  5. Otherwise the one capable model that is loaded, if only one is (``only_loaded``), else
     ``ModelNotFound`` (404) naming the capable ones.
- ``Registry.lookup``: exact id or alias, no fallback (``GET /v1/models/{id}``).
- ``Registry.find`` and ``resolve_exact``: Ollama's naming, exact, with ``name:latest`` as
  ``name`` (``untagged``); ``resolve_exact`` also checks the capability.
- ``Registry.first_come``: a registry from entries that may collide, the later of two
  colliding entries left out (and handed back, so the caller can say so).

Imports only ``errors``: no Trio, no actors, no model code.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Literal

import attrs

from ..errors import ModelNotFound, NoModel, RequestInvalid

__all__ = ["Capability", "ModelEntry", "Registry", "alias_for", "untagged"]

Capability = Literal["chat", "completion", "embedding", "speech_to_text", "text_to_speech", "text_to_image", "vision"]

#: Ollama's default tag: ``name:latest`` is ``name``.
LATEST = ":latest"

_WHAT = {  # Ollama's words, and the audio tasks'
    "chat": "chat", "completion": "generate", "embedding": "embeddings",
    "speech_to_text": "speech-to-text", "text_to_speech": "text-to-speech", "text_to_image": "image generation",
}
_AUDIO = ("speech_to_text", "text_to_speech", "text_to_image")
_A_KIND = {
    "embedding": "an embedding", "speech_to_text": "a speech-to-text", "text_to_speech": "a text-to-speech",
    "text_to_image": "an image",
}


def alias_for(model_id: str) -> str:
    """The Anthropic-style alias every generative model also answers to."""
    return f"claude-turbospark-{model_id}"


def untagged(name: str) -> str:
    """``name`` without Ollama's default tag (``llama:latest`` is ``llama``)."""
    return name.removesuffix(LATEST)


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
    #: whether ``dimensions`` may cut an embedding model's vectors short (``Encoder.matryoshka``)
    matryoshka: bool | tuple[int, ...] = False
    #: A generative model's tokenizer and chat template (thread-safe), for counting a prompt's
    #: tokens without the model thread (``/v1/messages/count_tokens``).
    tokenizer: Any = attrs.field(default=None, eq=False, hash=False, repr=False)
    #: A loaded embedding model's inbox (``EmbeddingJob``s go there, ``System.embed``); a
    #: generation model's, its thread's ``SlotCommand``s (``System.slots``).
    inbox: Any = attrs.field(default=None, eq=False, hash=False, repr=False)
    #: A loaded audio model's ``AudioInfo`` (its task, voices and sample rate).
    audio: Any = attrs.field(default=None, eq=False, hash=False)
    #: A loaded image model's ``ImageInfo`` (its sizes, steps and whether it edits).
    image: Any = attrs.field(default=None, eq=False, hash=False)
    #: What computes a loaded MLX model's layers (``mlx_kernels.install``), for the startup lines.
    kernels: str = attrs.field(default="", eq=False, hash=False)
    #: A loaded MLX model's LoRA adapters by name, in ``serve --lora``'s order (llama.cpp's ids):
    #: each is also an alias (a request naming it gets the model with it: ``turns.sampling``).
    adapters: tuple[str, ...] = ()

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

    @classmethod
    def first_come(cls, entries: Iterable[ModelEntry]) -> tuple[Registry, list[tuple[ModelEntry, list[str]]]]:
        """The registry of ``entries`` where an entry answering to a name an earlier one has (a
        copy named like another's alias) is left out; the ones left out, each with those names."""
        taken: set[str] = set()
        kept: list[ModelEntry] = []
        left_out: list[tuple[ModelEntry, list[str]]] = []
        for entry in entries:
            if taken.isdisjoint(entry.names):
                taken.update(entry.names)
                kept.append(entry)
            else:
                left_out.append((entry, sorted(taken & set(entry.names))))
        return cls(tuple(kept)), left_out

    def public_names(self) -> list[str]:
        return [name for entry in self.entries for name in entry.names]

    def lookup(self, name: str) -> ModelEntry | None:
        """Exact id or alias, no fallback."""
        for entry in self.entries:
            if name in entry.names:
                return entry
        return None

    def find(self, name: str) -> ModelEntry | None:
        """Ollama's lookup: exact id or alias, ``name:latest`` as ``name``; as Ollama, a name
        that matches nothing as written is tried in lower case (the store keeps Ollama names
        lower-cased)."""
        for candidate in dict.fromkeys((name, name.lower())):
            entry = self.lookup(candidate)
            if entry is None and candidate.endswith(LATEST):
                entry = self.lookup(untagged(candidate))
            if entry is not None:
                return entry
        return None

    def resolve_exact(self, name: str, want: Capability) -> ModelEntry:
        """``find``, or Ollama's 404; a model that cannot do ``want`` is a 400."""
        entry = self.find(name)
        if entry is None:
            raise ModelNotFound(name, [])
        if want not in entry.capabilities:
            if want in _AUDIO:  # the audio routes' words
                kind = next((_A_KIND[c] for c in entry.capabilities if c in _A_KIND), "a chat")
                raise RequestInvalid(f"model '{entry.id}' is {kind} model, not {_A_KIND[want]} one", param="model")
            raise RequestInvalid(f"model '{entry.id}' does not support {_WHAT[want]}", param="model")
        return entry

    def resolve(self, name: str | None, want: Capability = "chat", loaded: Collection[str] = ()) -> ModelEntry:
        """The policy above; ``loaded``: the ids of the models loaded now (rule 5)."""
        capable: Sequence[ModelEntry] = [e for e in self.entries if want in e.capabilities]
        if name:
            for entry in capable:
                if name in entry.names:
                    return entry
        if not capable:
            raise NoModel()
        if len(capable) == 1:
            return capable[0]
        return self.only_loaded(name, want, loaded)

    def only_loaded(self, name: str | None, want: Capability, loaded: Collection[str]) -> ModelEntry:
        """Several capable models, none named: the one loaded, if only one is; else
        ``ModelNotFound`` naming the capable ones."""
        capable = [e for e in self.entries if want in e.capabilities]
        hits = [e for e in capable if e.id in loaded]
        if len(hits) == 1:
            return hits[0]
        raise ModelNotFound(name or "", [e.id for e in capable])
