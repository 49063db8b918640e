"""The model thread: the only code that crosses from an OS thread into Trio.

One pinned OS thread per model loads the backend and runs every generation for it (MLX streams
are thread-local, and the KV cache stays with the thread).  It never touches a Trio object
directly; everything goes through ``trio.from_thread``:

- ``from_thread.run(take)`` asks the generation queue for the next job;
- after every prefill chunk and every decode step it calls ``from_thread.check_cancelled()``
  (the model actor is shutting down) and sends a reply with
  ``from_thread.run_sync(reply.send_nowait, ...)`` -- ``BrokenResourceError`` there means the
  route closed its receive end: the client is gone, and the job stops right here;
- between prefill chunks there is nothing to send, so it asks whether the receive end is still
  open (``statistics().open_receive_channels``), the same signal a send would give;
- it never waits on a client: the route sizes the reply buffer to hold every message a job can
  send (Queued, Started, one ``Delta`` per token of the budget, a stop-string tail, Finished).
  A client that stays connected but stops reading therefore cannot stall the model for the
  others.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
import attrs
import trio

from ..errors import ContextOverflow, GenerationFailed, RequestInvalid, TurboSparkError
from ..messages import (
    ChatPrompt,
    Delta,
    Failed,
    Finished,
    Generated,
    GenerationBegan,
    GenerationJob,
    Phase,
    Reply,
    Started,
    StopReason,
    TextPrompt,
)
from .backend import Backend, PrefillProgress
from .stops import StopMatcher

__all__ = ["encode_prompt", "serve_model"]


def serve_model(
    make_backend: Callable[[], Backend],
    take: Callable[[], Awaitable[GenerationJob | None]],
    emit: Callable[[object], None],
    ready: Callable[[Backend], None],
) -> None:
    """Body of a model thread: load, say ready, then run jobs until ``take`` returns None."""
    backend = make_backend()
    trio.from_thread.run_sync(ready, backend)
    while (job := trio.from_thread.run(take)) is not None:
        try:
            _run_job(backend, job, emit)
        except trio.BrokenResourceError:
            pass  # the client left; _run_job has reported it


def _send(job: GenerationJob, message: Reply) -> None:
    """Deliver a reply; raises ``BrokenResourceError`` when the route has left."""
    trio.from_thread.run_sync(job.reply.send_nowait, message)


def _gone(reply: trio.MemorySendChannel[Reply]) -> bool:
    return reply.statistics().open_receive_channels == 0


def _probe(job: GenerationJob) -> None:
    """Between prefill chunks: raise ``BrokenResourceError`` if the route has closed its receive
    end, as a send would, without putting anything in the buffer."""
    if trio.from_thread.run_sync(_gone, job.reply):
        raise trio.BrokenResourceError


def encode_prompt(backend: Backend, job: GenerationJob) -> list[int]:
    tok = backend.tokenizer
    prompt = job.prompt
    if isinstance(prompt, ChatPrompt):
        ids = tok.encode_chat(
            prompt.messages, tools=prompt.tools or None, template_kwargs=prompt.template_kwargs
        )
    else:
        assert isinstance(prompt, TextPrompt)
        ids = tok.encode(prompt.text, add_bos=tok.add_bos_token)
    if not ids:
        raise RequestInvalid("the prompt is empty", param="messages")
    budget = job.params.max_tokens
    if len(ids) + budget > backend.context_window:
        raise ContextOverflow(
            f"This model's context window is {backend.context_window} tokens; the prompt has "
            f"{len(ids)} tokens and max_tokens asks for {budget} more. Shorten the prompt or "
            "lower max_tokens.",
            param="max_tokens",
        )
    return ids


@attrs.define
class _Tally:
    """What one job did, for the observer's ``Generated`` event."""

    began: float
    phase: Phase = "queued"
    stop_reason: StopReason | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    cached: int = 0
    prefilled: int = 0
    prefill_end: float | None = None
    reported: bool = False

    def event(self, job: GenerationJob, model: str) -> Generated:
        assert self.stop_reason is not None
        ended = time.monotonic()
        prefill_end = self.prefill_end
        return Generated(
            id=job.request_id,
            model=model,
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            prefill_seconds=(prefill_end or ended) - self.began,
            decode_seconds=ended - prefill_end if prefill_end else 0.0,
            stop_reason=self.stop_reason,
            reused_prefix_tokens=self.cached,
            prefilled_tokens=self.prompt_tokens if prefill_end else self.prefilled,
            phase=self.phase if self.stop_reason == "Cancelled" else None,
            ttft_seconds=prefill_end - job.created if prefill_end else None,
            began=self.phase != "queued",
        )


def _run_job(backend: Backend, job: GenerationJob, emit: Callable[[object], None]) -> None:
    tok = backend.tokenizer
    params = job.params
    tally = _Tally(began=time.monotonic())
    steps = None

    def report() -> None:
        tally.reported = True
        trio.from_thread.run_sync(emit, tally.event(job, backend.model_id))

    try:
        try:
            ids = encode_prompt(backend, job)
        except RequestInvalid as exc:
            _send(job, Failed(exc))
            return
        tally.prompt_tokens = len(ids)
        _send(job, Started(len(ids)))
        trio.from_thread.run_sync(emit, GenerationBegan(job.request_id, backend.model_id))
        tally.phase = "prefill"
        decoder = tok.stream_decoder()
        stops = StopMatcher(params.stop)
        steps = backend.generate(ids, params)
        for item in steps:
            trio.from_thread.check_cancelled()
            if isinstance(item, PrefillProgress):
                tally.cached, tally.prefilled = item.cached, item.done
                if item.done:
                    _probe(job)
                continue
            if tally.phase == "prefill":
                tally.phase = "decode"
                tally.prefill_end = time.monotonic()
            tally.new_tokens += 1
            if item in tok.stop_ids:
                tally.stop_reason = "Eos" if item == tok.eos_id else "EndOfTurn"
                break
            text = stops.feed(decoder.add(item))
            if stops.matched is not None:
                tally.stop_reason = "StopString"
            elif tally.new_tokens >= params.max_tokens:
                tally.stop_reason = "MaxTokens"
            else:
                _send(job, Delta(text))
                continue
            if text:
                _send(job, Delta(text))
            break
        else:
            tally.stop_reason = "EndOfTurn"
        if stops.matched is None:  # text the decoder or the stop matcher still held back
            tail = stops.feed(decoder.flush())
            if stops.matched is not None:
                tally.stop_reason = "StopString"
            else:
                tail += stops.flush()
            if tail:
                _send(job, Delta(tail))
        report()
        _send(
            job,
            Finished(
                finish_reason="length" if tally.stop_reason == "MaxTokens" else "stop",
                stop_reason=tally.stop_reason,
                prompt_tokens=tally.prompt_tokens,
                completion_tokens=tally.new_tokens,
                cached_tokens=tally.cached,
            ),
        )
    except (trio.BrokenResourceError, trio.Cancelled):
        tally.stop_reason = "Cancelled"
        raise
    except Exception as exc:  # the backend failed: report it, keep the thread serving
        tally.stop_reason = "Error"
        error = exc if isinstance(exc, TurboSparkError) else GenerationFailed(f"generation failed: {exc}")
        _try_send(job, Failed(error))
    finally:
        if steps is not None:
            steps.close()
        if tally.stop_reason is not None and not tally.reported:
            report()
        trio.from_thread.run_sync(job.reply.close)


def _try_send(job: GenerationJob, message: Reply) -> None:
    try:
        _send(job, message)
    except (trio.BrokenResourceError, trio.WouldBlock):
        pass
