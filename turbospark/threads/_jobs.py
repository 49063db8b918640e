"""What the model thread keeps per job and per sequence, and the ``Generated`` event it ends with.

A job is one request: one sequence, or ``n`` sequences (choices) that share its prompt's
prefill and its reply channel.  Plain records, no I/O: the batch (``_batch``) changes them, the
crossing (``model_thread``) carries their outboxes to Trio.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from ..messages import Generated, GenerationJob, Reply
from ..model.backend import SamplingParams
from ..model.sequence import SequenceState, StopReason

__all__ = ["Choice", "Job", "generated"]


@attrs.define(eq=False)
class Choice:
    """One sequence of a job: its engine id and its own state."""

    job: Job
    index: int
    params: SamplingParams
    sid: int
    state: SequenceState


@attrs.define(eq=False)
class Job:
    """One job on this thread: waiting for room, running (its choices in the batch), or ended
    with final replies still to deliver.  Its choices share the reply channel."""

    job: GenerationJob
    ids: list[int] = attrs.field(factory=list)
    grow: int = 0  # tokens each of its choices may grow to (prompt and budget)
    choices: list[Choice] = attrs.field(factory=list)
    outbox: list[Reply] = attrs.field(factory=list)
    close: bool = False  # the reply channel closes once the outbox is out
    admitted: bool = False  # its slots are reserved, Started is on its way
    inserted: bool = False  # in the engine (after its route has had Started)
    cached: int = 0
    in_reasoning: bool = False  # the prompt opened a reasoning span
    images: Any = None  # what the backend's vision side made of its images (None: it has none)


def generated(job: Job, model: str, reason: StopReason) -> Generated:
    """The observer's record of how ``job`` ended."""
    request = job.job
    if not job.inserted:  # it never ran
        return Generated(
            id=request.request_id, model=model, prompt_tokens=len(job.ids),
            new_tokens=0, prefill_seconds=0.0, decode_seconds=0.0, stop_reason=reason,
            reused_prefix_tokens=0, phase="queued" if reason == "Cancelled" else None,
            began=False,
        )
    state = job.choices[0].state
    ended = time.monotonic()
    prefill_end = state.prefill_end
    return Generated(
        id=request.request_id,
        model=model,
        prompt_tokens=state.prompt_tokens,
        new_tokens=sum(c.state.new_tokens for c in job.choices),
        prefill_seconds=(prefill_end or ended) - state.began,
        decode_seconds=ended - prefill_end if prefill_end else 0.0,
        stop_reason=reason,
        reused_prefix_tokens=state.cached,
        prefilled_tokens=state.prompt_tokens if prefill_end else state.prefilled,
        phase=state.phase if reason == "Cancelled" else None,
        ttft_seconds=prefill_end - request.created if prefill_end else None,
        queue_seconds=state.began - request.created,
        total_seconds=ended - request.created,
        token_gaps=tuple(g for c in job.choices for g in c.state.gaps),
    )
