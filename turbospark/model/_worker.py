"""The model thread: one batch of sequences, and the only code that crosses into Trio.

One pinned OS thread per model loads the backend and runs every generation for it (MLX streams
are thread-local, and the KV caches stay with the thread).  It never touches a Trio object
directly; everything goes through ``trio.from_thread``.  Its loop:

    while True:
        start()     # admitted jobs whose routes have had Started enter the engine
        step()      # one engine step: a prefill chunk for newcomers, one decode step for the rest
        admit()     # waiting jobs get slots when the batch has room (slots and KV budget)
        exchange()  # one crossing into Trio: every job's news out, leaving clients and new
                    # jobs in

A job is one request: one sequence, or ``n`` sequences (choices) that share its prompt's
prefill and its reply channel.

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
from typing import Any

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
    TokenLogprob,
)
from ._admission import Admission
from .backend import Backend, SamplingParams, StepOutput
from .output import OutputParser
from .sequence import SequenceState, StopReason
from .tokenizer import Tokenizer

__all__ = ["Limits", "encode_prompt", "render_prompt", "serve_model"]

log = logging.getLogger("turbospark.model")

Take = Callable[[int, bool], Awaitable["list[GenerationJob] | None"]]


def deliver(
    emit: Callable[[object], None],
    events: Iterable[object],
    news: Iterable[tuple[trio.MemorySendChannel[Any], list[Any], bool]],
) -> list[int]:
    """One crossing's work on the Trio thread (model and encoder threads alike): emit the
    events, send each reply channel its messages (or, with none, ask whether its route still
    listens), close the ended ones; the indices of the channels whose routes are gone."""
    for event in events:
        emit(event)
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


@attrs.frozen
class Limits:
    """How much one model thread runs at once (from ``Settings``)."""

    max_batch: int
    kv_budget: int  # bytes of KV cache the running batch may grow to
    special_tokens_in_content: bool = False  # --special-tokens-in-content: trust content's markup


def serve_model(
    make_backend: Callable[[], Backend],
    take: Take,
    emit: Callable[[object], None],
    ready: Callable[[Backend], None],
    limits: Limits,
) -> None:
    """Body of a model thread: load, say ready, then run batches until shutdown."""
    backend = make_backend()
    trio.from_thread.run_sync(ready, backend)
    admission = Admission(limits.max_batch, limits.kv_budget, backend.kv_estimate)
    _Loop(backend, take, emit, admission, limits.special_tokens_in_content).run()


def render_prompt(
    tok: Tokenizer,
    prompt: ChatPrompt | TextPrompt,
    limit: int | None = None,
    *,
    special_tokens_in_content: bool = False,
) -> tuple[list[int], bool]:
    """A prompt's token ids, and whether it leaves the model inside a reasoning span.  The
    model thread and ``count_tokens`` both count with this, so they agree exactly.  Special-token
    text in a message's content stays plain text unless ``special_tokens_in_content``.

    With ``limit``, a prompt of surely more tokens is refused (``ContextOverflow``) without
    being encoded in full (see ``Tokenizer.surely_longer``): a 25 MiB prompt would otherwise
    hold the model thread, and every stream it runs, for seconds."""
    if isinstance(prompt, ChatPrompt):
        text = tok.render_chat(
            prompt.messages, tools=prompt.tools or None, template_kwargs=prompt.template_kwargs
        )
        _within(tok, text, limit)
        if special_tokens_in_content:
            return tok.encode(text), tok.opens_reasoning(text)
        contents = [m["content"] for m in prompt.messages if isinstance(m.get("content"), str)]
        return tok.encode_rendered(text, contents), tok.opens_reasoning(text)
    assert isinstance(prompt, TextPrompt)
    _within(tok, prompt.text, limit)
    return tok.encode(prompt.text, add_bos=tok.add_bos_token), False


def _within(tok: Tokenizer, text: str, limit: int | None) -> None:
    if limit is not None and tok.surely_longer(text, limit):
        raise ContextOverflow(
            f"The prompt has more than {limit} tokens, more than this model can read. Shorten the prompt.",
            param="messages",
        )


def encode_prompt(
    backend: Backend, job: GenerationJob, *, special_tokens_in_content: bool = False
) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether it leaves the model inside a reasoning span."""
    ids, in_reasoning = render_prompt(
        backend.tokenizer, job.prompt, backend.context_window,
        special_tokens_in_content=special_tokens_in_content,
    )
    if not ids:
        raise RequestInvalid("the prompt is empty", param="messages")
    budget = job.params.max_tokens
    if job.clamp and len(ids) < backend.context_window:
        budget = min(budget, backend.context_window - len(ids))
    if len(ids) + budget > backend.context_window:
        raise ContextOverflow(
            f"This model's context window is {backend.context_window} tokens; the prompt has "
            f"{len(ids)} tokens and max_tokens asks for {budget} more. Shorten the prompt or "
            "lower max_tokens.",
            param="max_tokens",
        )
    return ids, in_reasoning


@attrs.define(eq=False)
class _Choice:
    """One sequence of a job: its engine id and its own state."""

    job: _Job
    index: int
    params: SamplingParams
    sid: int
    state: SequenceState


@attrs.define(eq=False)
class _Job:
    """One job on this thread: waiting for room, running (its choices in the batch), or ended
    with final replies still to deliver.  Its choices share the reply channel."""

    job: GenerationJob
    ids: list[int] = attrs.field(factory=list)
    grow: int = 0  # tokens each of its choices may grow to (prompt and budget)
    choices: list[_Choice] = attrs.field(factory=list)
    outbox: list[Reply] = attrs.field(factory=list)
    close: bool = False  # the reply channel closes once the outbox is out
    admitted: bool = False  # its slots are reserved, Started is on its way
    inserted: bool = False  # in the engine (after its route has had Started)
    cached: int = 0
    in_reasoning: bool = False  # the prompt opened a reasoning span


# One entry per job in a crossing: its reply channel, what to send (nothing: only ask whether
# the route still listens), and whether to close the channel afterwards.
_News = tuple[trio.MemorySendChannel[Reply], list[Reply], bool]


class _Loop:
    def __init__(
        self, backend: Backend, take: Take, emit: Callable[[object], None], admission: Admission,
        special_tokens_in_content: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens_in_content = special_tokens_in_content
        self.take = take
        self.emit = emit
        self.admission = admission
        self.running: dict[int, _Choice] = {}  # by engine id
        self.jobs: list[_Job] = []  # running, in admission order
        self.waiting: deque[_Job] = deque()  # taken from the queue, waiting for room
        self.ended: list[_Job] = []  # with final replies still to deliver
        self.forks: dict[int, list[_Choice]] = {}  # choice 0's id -> the choices that share its prefill
        self.events: list[object] = []
        self.seq_ids = itertools.count()
        self.queue_open = True
        self.batch_state = (0, 0)

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                trio.from_thread.check_cancelled()
                self._start()
                if self.running:
                    self._step()
                self._admit()
                idle = not self.jobs and not self.waiting
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
            error = GenerationFailed.new()
            log.exception("model %s: a batch step failed; its %d jobs fail with it (error id %s)",
                          self.backend.model_id, len(self.jobs), error.error_id)
            for job in list(self.jobs):
                self._fail(job, error, removed=True)
            try:
                self.backend.reset()
            except Exception:
                log.exception("model %s: resetting the engine failed", self.backend.model_id)
            return
        self._apply(out)

    def _apply(self, out: StepOutput) -> None:
        for sid, exc in out.failed.items():
            if (choice := self.running.get(sid)) is not None:
                self._fail(choice.job, self._logged("a sequence of request %d failed",
                                                    choice.job.job.request_id, exc_info=exc))
        for sid, progress in out.progress.items():
            if (choice := self.running.get(sid)) is not None:
                choice.state.progress(progress)
                if progress.done == progress.total and sid in self.forks:
                    self._fork(sid)
        for sid, token in out.tokens.items():
            choice = self.running.get(sid)
            if choice is None:
                continue
            job, state = choice.job, choice.state
            try:
                logprob = self._logprob(token, out.logprobs.get(sid))
                parts = state.feed(token)
                job.outbox.append(
                    Delta(parts.content, choice.index, logprob, parts.reasoning, parts.calls)
                )
                if state.stop_reason is not None:
                    self._finish(choice)
            except Exception:
                self._fail(job, self._logged("ending request %d failed", job.job.request_id))

    def _logprob(
        self, token: int, found: tuple[float, tuple[tuple[int, float], ...]] | None
    ) -> TokenLogprob | None:
        if found is None:
            return None
        decode = self.backend.tokenizer.decode
        chosen, top = found
        return TokenLogprob(decode([token]), chosen, tuple((decode([i]), lp) for i, lp in top))

    def _fork(self, sid: int) -> None:
        """Choice 0 has read the prompt: the other choices start from its KV cache."""
        others = self.forks.pop(sid)
        job = others[0].job
        try:
            if not self.backend.fork(sid, {c.sid: c.params for c in others}):
                for c in others:  # its cache cannot be shared: each reads the prompt itself
                    self.backend.insert(c.sid, job.ids, c.params)
        except Exception:
            self._fail(job, self._logged("sharing the prompt of request %d failed", job.job.request_id))

    # --- admission -------------------------------------------------------------------------

    def _accept(self, job: GenerationJob) -> None:
        """A job from the queue: tokenise it and check it fits, then wait for room."""
        entry = _Job(job)
        try:
            entry.ids, entry.in_reasoning = encode_prompt(
                self.backend, job, special_tokens_in_content=self.special_tokens_in_content
            )
            room = self.backend.context_window - len(entry.ids)
            if job.params.max_tokens > room:  # a clamping job: its budget is what the context leaves
                entry.job = job = attrs.evolve(job, params=attrs.evolve(job.params, max_tokens=room))
            entry.grow = len(entry.ids) + job.params.max_tokens
            if job.params.grammar is not None:  # compiled now: a schema it cannot enforce is a 400
                self.backend.tokenizer.grammars.compile(job.params.grammar)
            vocab = self.backend.tokenizer.vocab_size
            if any(not 0 <= i < vocab for i, _ in job.params.logit_bias):
                raise RequestInvalid(
                    f"logit_bias names a token id outside this model's vocabulary (0-{vocab - 1})",
                    param="logit_bias")
            if job.n > self.admission.max_batch:
                raise RequestInvalid(
                    f"n is {job.n}, but this model runs at most {self.admission.max_batch} "
                    "sequences at once", param="n")
            if job.n > 1 and self.admission.cost([entry.grow] * job.n) > self.admission.kv_budget:
                raise RequestInvalid(
                    f"{job.n} choices of {len(entry.ids)} prompt tokens and up to "
                    f"{job.params.max_tokens} new tokens each need more KV-cache memory than "
                    "this model may use; lower n or max_tokens", param="n")
        except Exception as exc:
            if not isinstance(exc, TurboSparkError):
                exc = self._logged("preparing request %d failed", job.request_id)
            entry.outbox.append(Failed(exc))
            entry.close = True
            self.ended.append(entry)
            return
        self.waiting.append(entry)

    def _admit(self) -> None:
        while self.waiting and self.admission.fits(self.waiting[0].grow, self.waiting[0].job.n):
            job = self.waiting.popleft()
            tok = self.backend.tokenizer
            params = job.job.params
            for i in range(job.job.n):
                # with a seed, choice i draws from seed + i: reproducible, and distinct
                own = params if i == 0 or params.seed is None else attrs.evolve(params, seed=params.seed + i)
                state = SequenceState(
                    params=own,
                    decoder=tok.stream_decoder(),
                    stop_ids=tok.stop_ids,
                    eos_id=tok.eos_id,
                    prompt_tokens=len(job.ids),
                    created=job.job.created,
                    parser=OutputParser(
                        tok.dialect,
                        tools=job.job.prompt.tools,
                        in_reasoning=job.in_reasoning,
                    ),
                )
                choice = _Choice(job, i, own, next(self.seq_ids), state)
                job.choices.append(choice)
                self.running[choice.sid] = choice
                self.admission.admit(choice.sid, job.grow)
            job.admitted = True
            self.jobs.append(job)
            job.outbox.append(Started(len(job.ids), self._cached_prefix(job.ids)))

    def _cached_prefix(self, ids: list[int]) -> int:
        try:
            return int(self.backend.cached_prefix(ids))
        except Exception:  # a report, never a reason to fail the job
            log.exception("model %s: looking up the prefix cache failed", self.backend.model_id)
            return 0

    def _start(self) -> None:
        """Admitted jobs whose routes have had ``Started`` (and stayed) enter the engine."""
        for job in self.jobs:
            if job.inserted:
                continue
            job.inserted = True
            self.events.append(GenerationBegan(job.job.request_id, self.backend.model_id))
            first, *others = job.choices
            try:
                job.cached = self.backend.insert(first.sid, job.ids, first.params)
            except Exception:
                self._fail(job, self._logged("starting request %d failed", job.job.request_id))
                continue
            for choice in job.choices:
                choice.state.cached = choice.state.prefilled = job.cached
            if others:
                self.forks[first.sid] = others

    # --- how a job ends --------------------------------------------------------------------

    def _finish(self, choice: _Choice) -> None:
        job, state = choice.job, choice.state
        assert state.stop_reason is not None
        # Its KV goes back to the prefix cache (raising: _fail); of several choices only the
        # first's, so one request's siblings do not push other conversations out of it.
        self.backend.remove(choice.sid, keep_cache=choice.index == 0)
        self._release(choice)
        job.outbox.append(Finished(
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            stop_sequence=state.stops.matched,
            prompt_tokens=len(job.ids),
            completion_tokens=state.new_tokens,
            cached_tokens=job.cached,
            index=choice.index,
        ))
        if not self._live(job):
            self._end(job, None, state.stop_reason)

    def _logged(self, what: str, request_id: int, *, exc_info: object = True) -> GenerationFailed:
        """The error a client gets for an internal failure: an id, and a log line (with the
        traceback) that shows the same id."""
        error = GenerationFailed.new()
        log.error("model %s: " + what + " (error id %s)", self.backend.model_id, request_id,
                  error.error_id, exc_info=exc_info)
        return error

    def _fail(self, job: _Job, error: GenerationFailed, *, removed: bool = False) -> None:
        """Something one of the job's sequences did raised: the job fails, alone."""
        self._stop(job, "Error", remove=not removed, keep_cache=False)
        self._end(job, Failed(error), "Error")

    def _gone(self, job: _Job) -> None:
        """The route stopped listening: stop every choice, keep what their KV caches hold."""
        if not job.admitted:
            self.waiting.remove(job)
            self.events.append(self._generated(job, "Cancelled"))
            job.close = True
            self.ended.append(job)
            return
        self._stop(job, "Cancelled")
        self._end(job, None, "Cancelled")

    def _stop(self, job: _Job, reason: StopReason, *, remove: bool = True, keep_cache: bool = True) -> None:
        """End the job's choices still in the batch: out of the engine (unless it is past
        saving), their slots free."""
        for choice in self._live(job):
            if remove:
                try:
                    self.backend.remove(choice.sid, keep_cache=keep_cache)
                except Exception:
                    log.exception("model %s: removing a sequence of request %d failed",
                                  self.backend.model_id, job.job.request_id)
            choice.state.end(reason)
            self._release(choice)

    def _live(self, job: _Job) -> list[_Choice]:
        """The job's choices still in the batch."""
        return [c for c in job.choices if c.sid in self.running]

    def _release(self, choice: _Choice) -> None:
        self.running.pop(choice.sid, None)
        self.forks.pop(choice.sid, None)
        self.admission.release(choice.sid)

    def _end(self, job: _Job, last: Reply | None, reason: StopReason) -> None:
        self.events.append(self._generated(job, reason))
        if last is not None:
            job.outbox.append(last)
        job.close = True
        if job in self.jobs:
            self.jobs.remove(job)
        self.ended.append(job)

    def _generated(self, job: _Job, reason: StopReason) -> Generated:
        request = job.job
        if not job.inserted:  # it never ran
            return Generated(
                id=request.request_id, model=self.backend.model_id, prompt_tokens=len(job.ids),
                new_tokens=0, prefill_seconds=0.0, decode_seconds=0.0, stop_reason=reason,
                reused_prefix_tokens=0, phase="queued" if reason == "Cancelled" else None,
                began=False,
            )
        state = job.choices[0].state
        ended = time.monotonic()
        prefill_end = state.prefill_end
        return Generated(
            id=request.request_id,
            model=self.backend.model_id,
            prompt_tokens=state.prompt_tokens,
            new_tokens=sum(c.state.new_tokens for c in job.choices),
            prefill_seconds=(prefill_end or ended) - state.began,
            decode_seconds=ended - prefill_end if prefill_end else 0.0,
            stop_reason=reason,
            reused_prefix_tokens=state.cached,
            prefilled_tokens=state.prompt_tokens if prefill_end else state.prefilled,
            phase=state.phase if reason == "Cancelled" else None,
            ttft_seconds=prefill_end - request.created if prefill_end else None,
        )

    # --- the crossing ----------------------------------------------------------------------

    def _exchange(self, want: int, *, wait: bool) -> list[GenerationJob] | None:
        """Deliver every job's news (one crossing), drop the jobs whose routes left, and take up
        to ``want`` new jobs."""
        self._note_batch_state()
        jobs = [*self.ended, *self.jobs, *self.waiting]
        news: list[_News] = [(j.job.reply, j.outbox, j.close) for j in jobs]
        events, self.events, self.ended = self.events, [], []
        for j in jobs:
            j.outbox = []
        if want:
            gone, taken = trio.from_thread.run(self._trio_exchange, events, news, want, wait)
        else:
            gone, taken = trio.from_thread.run_sync(self._deliver, events, news), []
        for i in gone:
            if not jobs[i].close:
                self._gone(jobs[i])
        return taken

    def _deliver(self, events: list[object], news: Iterable[_News]) -> list[int]:
        return deliver(self.emit, events, news)

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
        """Cancelled (or the loop itself broke): every job here gets its documented end."""
        for job in list(self.jobs):
            self._stop(job, "Shutdown", remove=False)  # the engine goes with the thread
            self._end(job, Failed(ShuttingDown()), "Shutdown")
        while self.waiting:
            job = self.waiting.popleft()
            self.events.append(self._generated(job, "Shutdown"))
            job.outbox.append(Failed(ShuttingDown()))
            job.close = True
            self.ended.append(job)
        try:
            self._note_batch_state()
            news = [(j.job.reply, j.outbox, j.close) for j in self.ended]
            trio.from_thread.run_sync(self._deliver, self.events, news)
        except BaseException:  # the Trio side is gone already; nothing more can be said
            log.debug("model %s: final replies could not be delivered", self.backend.model_id)
