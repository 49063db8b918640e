"""The model thread: one batch of sequences, and the only code that crosses into Trio.

One pinned OS thread per model loads the backend and runs every generation for it (MLX streams
are thread-local, and the KV caches stay with the thread).  It never touches a Trio object
directly; everything goes through ``trio.from_thread``.  Its loop has three verbs:

    while True:
        step()      # one engine step: a prefill chunk for newcomers, one decode step for the rest
        exchange()  # one crossing into Trio: every sequence's news out, leaving clients and new
                    # jobs in
        admit()     # new jobs join the batch when a slot and KV room are free

- ``exchange`` is one ``from_thread.run`` per step.  On the Trio side it emits the step's observer
  events, then, for every sequence, sends its replies with ``send_nowait`` (a ``Delta`` per
  decode step, even an empty one) or, for a sequence still in prefill or waiting for room, asks
  whether its route still listens (``statistics().open_receive_channels``).  A
  ``BrokenResourceError`` or a closed receive end marks the sequence as gone: the thread removes
  it from the batch before the next step.  That is the whole cancellation protocol, one step
  per sequence, whoever shares the batch.  Then, if the batch has room, it asks the queue for
  more jobs: without waiting while a batch runs, waiting when there is nothing to do.
- ``check_cancelled()`` runs before every step: shutdown stops the loop within one step, and
  every sequence still running or waiting is answered ``Failed(ShuttingDown)``.
- It never waits on a client: the route sizes the reply buffer to hold every message a job can
  send (Queued, Started, one ``Delta`` per token of the budget, Finished), so a client that stays
  connected but stops reading cannot stall the batch.
- A sequence's failure is its own: whatever one sequence raises (in the engine, while its output
  is decoded, while it ends or is cleaned up) answers that client with a 500 whose message names
  no internal detail, logs the traceback, and leaves the others running.  A step that fails as a
  whole (nothing names the sequence at fault) fails the sequences of that batch and resets the
  engine; the thread keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import attrs
import trio

from ..errors import ContextOverflow, GenerationFailed, RequestInvalid, ShuttingDown, TurboSparkError
from ..messages import (
    BatchState,
    ChatPrompt,
    Delta,
    Failed,
    Finished,
    Generated,
    GenerationBegan,
    GenerationJob,
    Reply,
    Started,
    TextPrompt,
)
from ._admission import Admission
from .backend import Backend, StepOutput
from .sequence import SequenceState, StopReason

__all__ = ["Limits", "encode_prompt", "serve_model"]

log = logging.getLogger("turbospark.model")

Take = Callable[[int, bool], Awaitable["list[GenerationJob] | None"]]


@attrs.frozen
class Limits:
    """How much one model thread runs at once."""

    max_batch: int = 16
    kv_budget: int = 2 << 30  # bytes of KV cache the running sequences may grow to


def serve_model(
    make_backend: Callable[[], Backend],
    take: Take,
    emit: Callable[[object], None],
    ready: Callable[[Backend], None],
    limits: Limits = Limits(),
) -> None:
    """Body of a model thread: load, say ready, then run batches until shutdown."""
    backend = make_backend()
    trio.from_thread.run_sync(ready, backend)
    _Loop(backend, take, emit, Admission(limits.max_batch, limits.kv_budget)).run()


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


@attrs.define(eq=False)
class _Seq:
    """One job on this thread: waiting for room (``state`` None), running, or ended."""

    job: GenerationJob
    sid: int = -1  # its id in the engine, once it runs
    ids: list[int] = attrs.field(factory=list)
    need: int = 0  # KV bytes it may grow to
    state: SequenceState | None = None
    outbox: list[Reply] = attrs.field(factory=list)
    close: bool = False  # the reply channel closes once the outbox is out


# One entry per sequence in a crossing: its reply channel, what to send (nothing: only ask
# whether the route still listens), and whether to close the channel afterwards.
_News = tuple[trio.MemorySendChannel[Reply], list[Reply], bool]


class _Loop:
    def __init__(self, backend: Backend, take: Take, emit: Callable[[object], None], admission: Admission) -> None:
        self.backend = backend
        self.take = take
        self.emit = emit
        self.admission = admission
        self.running: dict[int, _Seq] = {}
        self.waiting: deque[_Seq] = deque()  # taken from the queue, waiting for room
        self.ended: list[_Seq] = []  # with final replies still to deliver
        self.events: list[object] = []
        self.seq_ids = itertools.count()
        self.queue_open = True
        self.batch_state = (0, 0)

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                trio.from_thread.check_cancelled()
                if self.running:
                    self._step()
                self._admit()
                idle = not self.running and not self.waiting
                if idle and not self.queue_open:
                    self._exchange(0, wait=False)
                    return
                want = self.admission.free_slots() if self.queue_open and not self.waiting else 0
                jobs = self._exchange(want, wait=idle)
                if jobs is None:
                    self.queue_open = False  # the queue closed: shutdown is under way
                elif jobs:
                    for job in jobs:
                        self._accept(job)
                    self._admit()
                    self._exchange(0, wait=False)  # Started (or a refusal) before any prefill
        except BaseException:
            self._shutdown()
            raise

    def _step(self) -> None:
        try:
            out = self.backend.step()
        except Exception:
            log.exception("model %s: a batch step failed; its %d sequences fail with it",
                          self.backend.model_id, len(self.running))
            for sid in list(self.running):
                self._fail(sid, removed=True)
            try:
                self.backend.reset()
            except Exception:
                log.exception("model %s: resetting the engine failed", self.backend.model_id)
            return
        self._apply(out)

    def _apply(self, out: StepOutput) -> None:
        for sid, exc in out.failed.items():
            if sid in self.running:
                log.error("model %s: sequence of request %d failed", self.backend.model_id,
                          self.running[sid].job.request_id, exc_info=exc)
                self._fail(sid, removed=True)
        for sid, progress in out.progress.items():
            if (seq := self.running.get(sid)) is not None:
                assert seq.state is not None
                seq.state.progress(progress)
        for sid, token in out.tokens.items():
            seq = self.running.get(sid)
            if seq is None:
                continue
            assert seq.state is not None
            try:
                seq.outbox.append(Delta(seq.state.feed(token)))
                if seq.state.stop_reason is not None:
                    self._finish(sid)
            except Exception:
                log.exception("model %s: ending request %d failed", self.backend.model_id,
                              seq.job.request_id)
                self._fail(sid)

    # --- admission -------------------------------------------------------------------------

    def _accept(self, job: GenerationJob) -> None:
        """A job from the queue: tokenise it and check it fits the context, then wait for room."""
        seq = _Seq(job)
        try:
            seq.ids = encode_prompt(self.backend, job)
            seq.need = self.backend.kv_estimate(len(seq.ids) + job.params.max_tokens)
        except Exception as exc:
            if not isinstance(exc, TurboSparkError):
                log.exception("model %s: preparing request %d failed", self.backend.model_id, job.request_id)
                exc = GenerationFailed("generation failed")
            seq.outbox.append(Failed(exc))
            seq.close = True
            self.ended.append(seq)
            return
        self.waiting.append(seq)

    def _admit(self) -> None:
        while self.waiting and self.admission.fits(self.waiting[0].need):
            seq = self.waiting.popleft()
            seq.sid = sid = next(self.seq_ids)
            tok = self.backend.tokenizer
            seq.state = SequenceState(
                params=seq.job.params,
                decoder=tok.stream_decoder(),
                stop_ids=tok.stop_ids,
                eos_id=tok.eos_id,
                prompt_tokens=len(seq.ids),
                created=seq.job.created,
            )
            self.running[sid] = seq
            self.admission.admit(sid, seq.need)
            self.events.append(GenerationBegan(seq.job.request_id, self.backend.model_id))
            seq.outbox.append(Started(len(seq.ids)))
            try:
                cached = self.backend.insert(sid, seq.ids, seq.job.params)
            except Exception:
                log.exception("model %s: starting request %d failed", self.backend.model_id,
                              seq.job.request_id)
                self._fail(sid)
                continue
            seq.state.cached = seq.state.prefilled = cached

    # --- how a sequence ends ---------------------------------------------------------------

    def _finish(self, sid: int) -> None:
        seq = self.running[sid]
        state = seq.state
        assert state is not None and state.stop_reason is not None
        self.backend.remove(sid)  # its KV goes back to the prefix cache (raising: _fail)
        del self.running[sid]
        self.admission.release(sid)
        self._end(seq, Finished(
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.new_tokens,
            cached_tokens=state.cached,
        ))

    def _fail(self, sid: int, *, removed: bool = False) -> None:
        seq = self.running.pop(sid)
        assert seq.state is not None
        self.admission.release(sid)
        if not removed:
            try:
                self.backend.remove(sid, keep_cache=False)
            except Exception:
                log.exception("model %s: removing a failed sequence failed", self.backend.model_id)
        seq.state.stop_reason = "Error"
        self._end(seq, Failed(GenerationFailed("generation failed")))

    def _gone(self, seq: _Seq) -> None:
        """The route stopped listening: stop the sequence, keep what its KV cache holds."""
        if seq.state is None:
            self.waiting.remove(seq)
            self.events.append(self._generated(seq, "Cancelled"))
            seq.close = True
            self.ended.append(seq)
            return
        sid = seq.sid
        del self.running[sid]
        self.admission.release(sid)
        try:
            self.backend.remove(sid)
        except Exception:
            log.exception("model %s: removing a cancelled sequence failed", self.backend.model_id)
        seq.state.end("Cancelled")
        self._end(seq, None)

    def _end(self, seq: _Seq, last: Reply | None) -> None:
        assert seq.state is not None and seq.state.stop_reason is not None
        self.events.append(self._generated(seq, seq.state.stop_reason))
        if last is not None:
            seq.outbox.append(last)
        seq.close = True
        self.ended.append(seq)

    def _generated(self, seq: _Seq, reason: StopReason) -> Generated:
        job, state = seq.job, seq.state
        if state is None:  # it never left the waiting line
            return Generated(
                id=job.request_id, model=self.backend.model_id, prompt_tokens=len(seq.ids),
                new_tokens=0, prefill_seconds=0.0, decode_seconds=0.0, stop_reason=reason,
                reused_prefix_tokens=0, phase="queued", began=False,
            )
        ended = time.monotonic()
        prefill_end = state.prefill_end
        return Generated(
            id=job.request_id,
            model=self.backend.model_id,
            prompt_tokens=state.prompt_tokens,
            new_tokens=state.new_tokens,
            prefill_seconds=(prefill_end or ended) - state.began,
            decode_seconds=ended - prefill_end if prefill_end else 0.0,
            stop_reason=reason,
            reused_prefix_tokens=state.cached,
            prefilled_tokens=state.prompt_tokens if prefill_end else state.prefilled,
            phase=state.phase if reason == "Cancelled" else None,
            ttft_seconds=prefill_end - job.created if prefill_end else None,
        )

    # --- the crossing ----------------------------------------------------------------------

    def _exchange(self, want: int, *, wait: bool) -> list[GenerationJob] | None:
        """Deliver every sequence's news (one crossing), drop the sequences whose routes left,
        and take up to ``want`` new jobs."""
        self._note_batch_state()
        seqs = [*self.ended, *self.running.values(), *self.waiting]
        news: list[_News] = [(s.job.reply, s.outbox, s.close) for s in seqs]
        events, self.events, self.ended = self.events, [], []
        for s in seqs:
            s.outbox = []
        if want:
            gone, jobs = trio.from_thread.run(self._trio_exchange, events, news, want, wait)
        else:
            gone, jobs = trio.from_thread.run_sync(self._deliver, events, news), []
        for i in gone:
            if not seqs[i].close:
                self._gone(seqs[i])
        return jobs

    def _deliver(self, events: list[object], news: Iterable[_News]) -> list[int]:
        """On the Trio thread: emit the events, send the replies; the indices of the gone."""
        for event in events:
            self.emit(event)
        gone = []
        for i, (reply, messages, close) in enumerate(news):
            try:
                if not messages and reply.statistics().open_receive_channels == 0:
                    gone.append(i)
                for message in messages:
                    reply.send_nowait(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                gone.append(i)
            if close:
                reply.close()
        return gone

    async def _trio_exchange(
        self, events: list[object], news: list[_News], want: int, wait: bool
    ) -> tuple[list[int], list[GenerationJob] | None]:
        gone = self._deliver(events, news)
        return gone, await self.take(want, wait)

    def _note_batch_state(self) -> None:
        """A ``BatchState`` event when the batch grows or shrinks, or its KV memory has moved
        by a sixteenth (1 MiB at least) since the last one: enough for the gauges, few enough
        for the events file."""
        try:
            running, kv = len(self.running), self.backend.kv_bytes()
        except Exception:
            log.exception("model %s: reading the KV size failed", self.backend.model_id)
            return
        last_running, last_kv = self.batch_state
        moved = abs(kv - last_kv) >= max(1 << 20, last_kv // 16)
        if running != last_running or moved or (running == 0 and kv != last_kv):
            self.batch_state = (running, kv)
            self.events.append(BatchState(self.backend.model_id, running, kv))

    def _shutdown(self) -> None:
        """Cancelled (or the loop itself broke): every sequence here gets its documented end."""
        for sid, seq in list(self.running.items()):
            del self.running[sid]
            assert seq.state is not None
            seq.state.end("Shutdown")
            self._end(seq, Failed(ShuttingDown()))
        while self.waiting:
            seq = self.waiting.popleft()
            self.events.append(self._generated(seq, "Shutdown"))
            seq.outbox.append(Failed(ShuttingDown()))
            seq.close = True
            self.ended.append(seq)
        self.running.clear()
        try:
            self._note_batch_state()
            seqs = self.ended
            news = [(s.job.reply, s.outbox, s.close) for s in seqs]
            trio.from_thread.run_sync(self._deliver, self.events, news)
        except BaseException:  # the Trio side is gone already; nothing more can be said
            log.debug("model %s: final replies could not be delivered", self.backend.model_id)
