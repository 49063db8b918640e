"""Messages between routes, actors and the model threads (the message catalogue).

Every request/reply message carries the send end of a reply channel; the asker holds the receive
end in ``with reply_recv:``.  Closing that end is how a caller says "I am gone": the producer's
next send raises ``BrokenResourceError`` and it drops the work.  ``design/messages.md`` lists who
sends what to whom.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import numpy as np
import trio

from .errors import TurboSparkError
from .model.backend import SamplingParams
from .model.output import CallPiece, ToolCall
from .model.sequence import Phase, StopReason

__all__ = [
    "BatchState", "ChatPrompt", "Delta", "Embedded", "EmbeddingBatch", "EmbeddingJob", "EmbeddingReply",
    "Failed", "Finished", "GenerationJob", "Generated", "GenerationBegan", "Phase", "Progress", "QueueDepth",
    "FAULT_ACTORS", "JobFault", "QueueRejected", "ModelLoaded", "ModelUnloaded", "Open", "Reply",
    "RequestFinished", "Retire", "RequestRouted", "RequestStarted", "Started", "StopReason", "Submit",
    "Take", "TextPrompt", "TokenLogprob", "ToolCall", "Vectors", "Withdraw",
]

# --- what a route asks a model to generate -------------------------------------------------


@attrs.frozen
class ChatPrompt:
    """A conversation, rendered with the model's own chat template on the model thread."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)

    @property
    def images(self) -> tuple[bytes, ...]:  # a vision model's: its image parts' files, in order
        return tuple(p["data"] for m in self.messages if isinstance(m.get("content"), list)
                     for p in m["content"] if isinstance(p, dict) and p.get("type") == "image" and "data" in p)


@attrs.frozen
class TextPrompt:
    """Raw text, encoded as is (with BOS where the model wants one); no template.  ``tools``
    are not rendered (the text is the caller's): the output parser reads calls to them."""

    text: str
    tools: tuple[dict[str, Any], ...] = ()


@attrs.frozen(eq=False)
class GenerationJob:
    """One generation.  Compared by identity: a job is a unique piece of work."""

    request_id: int
    model: str
    prompt: ChatPrompt | TextPrompt
    params: SamplingParams
    reply: trio.MemorySendChannel[Reply]
    created: float  # time.monotonic() when the route accepted the request
    n: int = 1  # choices: the prompt is prefilled once and decoded n ways
    clamp: bool = False  # a budget past the context window is cut to what it leaves, not refused
    truncate: bool = False  # a prompt past the window loses its oldest messages (``threads/prompt._truncated``)


# --- replies a generation sends back, in order ----------------------------------------------


@attrs.frozen
class Started:
    """The prompt is tokenised and fits; prefill begins.  ``cached_tokens``: how much of it the
    prefix cache holds now (what the prefill will most likely reuse)."""

    prompt_tokens: int
    cached_tokens: int = 0


@attrs.frozen
class TokenLogprob:
    """A generated token as text, its log-probability, and the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class Delta:
    """One decode step of choice ``index``: ``text`` is the content that became safe to show
    (possibly empty), ``reasoning`` the reasoning, ``writing`` the arguments of calls being
    written, ``tool_calls`` the calls completed at this step; ``logprob`` describes the step's
    token when the request asked for log-probabilities."""

    text: str
    index: int = 0
    logprob: TokenLogprob | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    writing: tuple[CallPiece, ...] = ()


@attrs.frozen
class Finished:
    """Choice ``index`` ended; the job ends when all its choices have.  ``prompt_tokens`` and
    ``cached_tokens`` are the job's (the prompt is shared), ``completion_tokens`` the choice's."""

    finish_reason: Literal["stop", "length"]
    stop_reason: StopReason
    stop_sequence: str | None  # the stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    index: int = 0
    prefill_seconds: float = 0.0  # from admission to the first token (the prompt read)
    decode_seconds: float = 0.0  # from the first token to the last


@attrs.frozen
class Failed:
    error: TurboSparkError


@attrs.frozen
class Progress:
    """The prompt is being read: ``processed`` of its ``total`` tokens are in the KV cache,
    ``cache`` of them reused, ``seconds`` since the model started on it.  A report: delivered
    only into an empty reply buffer (a reader that is behind misses some), never in the way."""

    total: int
    cache: int
    processed: int
    seconds: float


Reply = Started | Delta | Finished | Failed | Progress


# --- the generation queue's inbox ----------------------------------------------------------


@attrs.frozen
class Submit:
    job: GenerationJob


@attrs.frozen
class Withdraw:
    """The route is leaving; drop the job if it has not been handed to the model yet."""

    job: GenerationJob


@attrs.frozen
class Take:
    """A model thread asks for ``count`` more jobs (negative: that many fewer than it asked for
    before), to be pushed into ``jobs``, its own jobs channel (the model holds the receive end;
    the queue never pushes more than the model asked for and was not sent).  ``pushed``, when
    given, is closed once the queue has pushed what it could."""

    model: str
    jobs: trio.MemorySendChannel[GenerationJob]
    count: int
    pushed: trio.MemorySendChannel[None] | None = None


@attrs.frozen
class Retire:
    """A model's thread has stopped (unloaded, or shutdown): its waiting jobs, and any submitted
    later, are answered ``ShuttingDown``, until the model is opened again."""

    model: str


@attrs.frozen
class Open:
    """The resolver is loading ``model`` (again): jobs for it are admitted from now on."""

    model: str


# --- observer events ----------------------------------------------------------------------


@attrs.frozen
class RequestStarted:
    id: int
    at_ms: int
    method: str
    path: str


@attrs.frozen
class RequestRouted:
    id: int
    requested: str | None
    served: str
    stream: bool


@attrs.frozen
class GenerationBegan:
    id: int
    model: str


@attrs.frozen
class Generated:
    id: int
    model: str
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: StopReason
    reused_prefix_tokens: int
    prefilled_tokens: int = 0  # prompt tokens in the KV cache when it stopped
    phase: Phase | None = None  # where a cancelled generation stopped
    ttft_seconds: float | None = None
    began: bool = True  # False when it was cancelled before the model started on it
    queue_seconds: float | None = None  # from accepted to the model starting on it
    total_seconds: float | None = None  # from accepted to the end
    token_gaps: tuple[float, ...] = ()  # seconds between consecutive tokens, every choice's


@attrs.frozen
class BatchState:
    """A model's running batch changed: how many sequences run, and the KV bytes they hold."""

    model: str
    running: int
    kv_bytes: int


@attrs.frozen
class ModelLoaded:
    """A model finished loading; ``size`` is the memory it holds (bytes)."""

    model: str
    seconds: float
    size: int


@attrs.frozen
class ModelUnloaded:
    """A model was unloaded: ``expired`` (idle past its keep_alive), ``evicted`` (room for
    another model), ``requested`` (keep_alive 0), ``failed`` (its load or its thread failed),
    ``cancelled`` (every request waiting for its load left) or ``shutdown``."""

    model: str
    reason: str


@attrs.frozen
class QueueDepth:
    model: str
    depth: int


@attrs.frozen
class JobFault:
    """A job failed on an internal fault (answered 500 with ``error_id``); the actor carries on.
    ``actor``: whose fault it was (one of ``FAULT_ACTORS``)."""

    model: str
    error_id: str
    actor: str = "model"


#: the actors whose faults are counted apart (``/health``'s ``faults``, ``turbospark_faults``)
FAULT_ACTORS = ("model", "encoder", "audio", "image", "observer")


@attrs.frozen
class QueueRejected:
    """A request was refused with ``queue_full``."""

    id: int
    model: str


@attrs.frozen
class RequestFinished:
    id: int
    route: str
    status: int
    duration_ms: float
    error: str | None = None


# --- slots: route -> a generation model's inbox -> its model thread -> route -------------------


@attrs.frozen(eq=False)
class SlotCommand:
    """llama.cpp's slot actions on a model's prefix cache (``model/prompt_slots.py``), run on
    its model thread: ``list``, ``save``, ``restore`` or ``erase``.  The reply is the answer's
    body, or the ``SlotError`` that says why not."""

    action: str
    slot: int | None
    filename: str | None
    reply: trio.MemorySendChannel[Any]


# --- embeddings: route -> embedding actor (its inbox) -> encoder thread -> route -------------


@attrs.frozen(eq=False)
class EmbeddingJob:
    """Vectors for ``inputs``, in order.  Compared by identity: a job is a unique piece of work.

    ``truncate``: cut inputs longer than the model reads (as sentence-transformers does);
    without it such an input fails the job with a 400."""

    request_id: int
    model: str
    inputs: tuple[str | tuple[int, ...], ...]  # texts, or token ids as the model reads them
    truncate: bool
    reply: trio.MemorySendChannel[EmbeddingReply]
    created: float  # time.monotonic() when the route accepted the request
    #: rerank: score ``inputs`` (the documents) against this query instead; a cross-encoder
    #: reads each (query, document) pair, an embedding model compares their vectors (cosine)
    query: str | None = None


@attrs.frozen(eq=False)
class Vectors:
    """The job's answer: one unit vector per input (``(len(inputs), width)`` float32), and the
    tokens the model read for all of them (special tokens included, after truncation)."""

    vectors: np.ndarray
    prompt_tokens: int
    #: a ``query`` job's scores ``(len(inputs), 1)`` are cosine similarities (no cross-encoder)
    by_similarity: bool = False


EmbeddingReply = Vectors | Failed

EmbeddingOutcome = Literal["Done", "Cancelled", "Error", "Shutdown"]


@attrs.frozen
class EmbeddingBatch:
    """One forward pass of an encoder: its inputs, the jobs they came from, the tokens they
    hold and the padded tokens the pass computed."""

    model: str
    inputs: int
    jobs: int
    tokens: int
    padded_tokens: int
    seconds: float


@attrs.frozen
class Embedded:
    """An embedding job ended: ``computed`` of its ``inputs`` had run (0 for a job dropped
    before its first batch)."""

    id: int
    model: str
    inputs: int
    computed: int
    prompt_tokens: int
    seconds: float
    outcome: EmbeddingOutcome
