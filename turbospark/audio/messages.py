"""Messages of the audio jobs actor and its worker threads (see ``design/messages.md``).

Routes ask the actor (``turbospark.actors.audio``) with a reply channel; work goes on to the
model's own bounded inbox, and the worker thread answers the route directly on the work's reply
channel.  Closing that channel's receive end is the route's "I am gone": the worker drops work
not yet started and stops work under way at its next step.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import numpy as np
import trio

from ..errors import TurboSparkError
from .engines import Task
from .wire import Transcript

__all__ = [
    "AudioBusyEvent",
    "AudioInfo",
    "AudioModelsChanged",
    "AudioRequest",
    "AudioWork",
    "AudioWorkBegan",
    "AudioWorkEnded",
    "Chunk",
    "DeleteJob",
    "Endpoint",
    "GetJob",
    "JobsChanged",
    "ListAudio",
    "ResolveAudio",
    "StartJob",
    "Synthesize",
    "Transcribe",
    "WorkDone",
    "WorkFailed",
]

Endpoint = Literal["transcriptions", "speech", "generate", "realtime", "models_load", "models_unload", "jobs"]


@attrs.frozen
class AudioInfo:
    """What routes may know about an attached audio model."""

    id: str
    task: Task
    created: int
    voices: tuple[str, ...] = ()
    sample_rate: int = 0


# --- work, from a route (through the actor) to a model's worker thread ---------------------


@attrs.frozen(eq=False)
class Transcribe:
    audio: np.ndarray  # 16 kHz mono float32
    language: str | None
    prefix: str = ""  # words already given for the audio's start: the transcript goes on from them


@attrs.frozen(eq=False)
class Synthesize:
    text: str
    voice: str
    speed: float


@attrs.frozen
class Chunk:
    """16-bit PCM, one sentence or segment of speech."""

    pcm: bytes


@attrs.frozen
class WorkDone:
    transcript: Transcript | None = None  # speech-to-text; text-to-speech ends with None


@attrs.frozen
class WorkFailed:
    error: TurboSparkError


WorkReply = Chunk | WorkDone | WorkFailed


@attrs.frozen(eq=False)
class AudioWork:
    request_id: int
    model: str
    endpoint: Endpoint
    args: Transcribe | Synthesize
    reply: trio.MemorySendChannel[WorkReply]
    created: float  # trio.current_time()


# --- asking the actor -----------------------------------------------------------------------


@attrs.frozen
class ResolveAudio:
    """Which attached model answers ``name`` for ``task`` (an ``AudioInfo`` or the error)."""

    name: str
    task: Task
    reply: trio.MemorySendChannel[AudioInfo | TurboSparkError]


@attrs.frozen
class SubmitAudio:
    """Queue ``work`` on its model (answered on ``work.reply``; a full queue is a 429 at once)."""

    work: AudioWork


@attrs.frozen
class ListAudio:
    reply: trio.MemorySendChannel[list[AudioInfo]]


@attrs.frozen
class StartJob:
    """Run ``work`` as an async job (its ``reply`` is the job's own); answered with the job's
    description, or the error (429 when too many jobs are unfinished)."""

    kind: str
    work: AudioWork
    render: Any  # (Transcript | bytes) -> (body, content type), on the actor
    reply: trio.MemorySendChannel[dict[str, Any] | TurboSparkError]


@attrs.frozen
class GetJob:
    job_id: str
    want: Literal["describe", "result"]
    reply: trio.MemorySendChannel[Any]


@attrs.frozen
class DeleteJob:
    job_id: str
    reply: trio.MemorySendChannel[dict[str, Any] | TurboSparkError]


# --- events (to the observer) ---------------------------------------------------------------


@attrs.frozen
class AudioRequest:
    endpoint: str
    status: int
    seconds: float


@attrs.frozen
class AudioBusyEvent:
    model: str


@attrs.frozen
class AudioWorkBegan:
    model: str
    endpoint: str


@attrs.frozen
class AudioWorkEnded:
    model: str
    endpoint: str
    outcome: Literal["done", "failed", "cancelled", "shutdown"]
    phase: Literal["queued", "running"]
    seconds: float  # compute time
    audio_seconds: float  # of audio heard or spoken


@attrs.frozen
class AudioModelsChanged:
    loaded: int


@attrs.frozen
class JobsChanged:
    counts: dict[str, int] = attrs.field(hash=False)
