"""The model thread's running batch: jobs in, engine steps, each job's replies out (no Trio).

``Batch`` owns everything the thread knows about its jobs: those waiting for room (taken, not
yet admitted), those running (their choices in the engine), and those ended with replies still
to deliver.  The thread loop (``model_thread``) calls it between crossings:

- ``accept``: a new job is prepared (``prompt.prepare``) and waits for room, or is answered at
  once with what it failed;
- ``admit``: waiting jobs get slots while the batch has room (``_admission``), oldest first, and
  their ``Started`` goes in the outbox;
- ``start``: admitted jobs whose ``Started`` went out enter the engine (so a client that left as
  its job was handed over never costs a prefill chunk);
- ``step``: one engine step, its tokens fed to each sequence's state, ends and failures applied;
- ``outgoing`` / ``departed``: what the next crossing carries, and the jobs whose routes had
  left by then.

A sequence's failure is its own: whatever one sequence raises (in the engine, while its output
is decoded, while it ends or is cleaned up) answers that client with a 500 whose message names
no internal detail, logs the traceback, and leaves the others running.  A step that fails as a
whole (nothing names the sequence at fault) fails the sequences of that batch and resets the
engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import attrs
import trio

from ..errors import GenerationFailed, ShuttingDown, TurboSparkError, inject
from ..messages import (
    BatchState, Delta, Failed, Finished, GenerationBegan, GenerationJob, JobFault, Progress, Reply, Started, TokenLogprob,
)
from ._admission import Admission
from ._jobs import Choice, Job, generated
from ..model.backend import Backend, StepOutput
from ..model.output import OutputParser
from .prompt import prepare
from ..model.sequence import SequenceState, StopReason

__all__ = ["Batch", "News"]

log = logging.getLogger("turbospark.model")

# One entry per job in a crossing: its reply channel, what to send (nothing: only ask whether
# the route still listens), and whether to close the channel afterwards.
News = tuple[trio.MemorySendChannel[Reply], list[Reply], bool]


class Batch:
    def __init__(self, backend: Backend, admission: Admission, special_tokens_in_content: bool = False) -> None:
        self.backend = backend
        self.admission = admission
        self.special_tokens_in_content = special_tokens_in_content
        self.running: dict[int, Choice] = {}  # by engine id
        self.jobs: list[Job] = []  # running, in admission order
        self.waiting: deque[Job] = deque()  # taken from the queue, waiting for room
        self.ended: list[Job] = []  # with final replies still to deliver
        self.forks: dict[int, list[Choice]] = {}  # choice 0's id -> the choices that share its prefill
        self.events: list[object] = []
        self.seq_ids = itertools.count()
        self.batch_state = (0, 0)

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits for room."""
        return not self.jobs and not self.waiting

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> None:
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
                try:
                    inject("prefill chunk")
                    choice.state.progress(progress)
                except Exception:
                    self._fail(choice.job, self._logged("prefilling request %d failed", choice.job.job.request_id))
                    continue
                if choice.index == 0:
                    choice.job.outbox.append(Progress(
                        progress.total, progress.cached, progress.done, time.monotonic() - choice.state.began))
                if progress.done == progress.total and sid in self.forks:
                    self._fork(sid)
        for sid, token in out.tokens.items():
            choice = self.running.get(sid)
            if choice is None:
                continue
            job, state = choice.job, choice.state
            try:
                inject("decode step")
                found = (out.logprobs.get(sid), *out.more_logprobs.get(sid, ()))
                for i, fed in enumerate(out.emitted(sid)):  # several after a speculative step
                    parts = state.feed(fed)
                    logprob = self._logprob(fed, found[i] if i < len(found) else None)
                    job.outbox.append(
                        Delta(parts.content, choice.index, logprob, parts.reasoning, parts.calls, parts.writing)
                    )
                    if state.stop_reason is not None:  # what follows the end never reaches the client
                        break
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
                    self._insert(job, c)
        except Exception:
            self._fail(job, self._logged("sharing the prompt of request %d failed", job.job.request_id))

    # --- admission ---------------------------------------------------------------------------

    def accept(self, job: GenerationJob) -> None:
        """A job from the queue: tokenise it and check it fits, then wait for room."""
        entry = Job(job)
        try:
            ready = prepare(self.backend, job, self.admission,
                            special_tokens_in_content=self.special_tokens_in_content)
        except Exception as exc:
            if not isinstance(exc, TurboSparkError):
                exc = self._logged("preparing request %d failed", job.request_id)
            entry.outbox.append(Failed(exc))
            entry.close = True
            self.ended.append(entry)
            return
        entry.job, entry.ids, entry.in_reasoning, entry.grow = ready.job, ready.ids, ready.in_reasoning, ready.grow
        entry.images = ready.images
        self.waiting.append(entry)

    def admit(self) -> None:
        while self.waiting and self.admission.fits(self.waiting[0].grow, self.waiting[0].job.n):
            job = self.waiting.popleft()
            try:
                self._admit(job)
            except Exception:  # that job fails alone; its batch-mates never notice
                self._fail(job, self._logged("admitting request %d failed", job.job.request_id), removed=True)

    def _admit(self, job: Job) -> None:
        """``job``'s sequences enter the batch: every choice's state, its slot, ``Started``."""
        inject("admission")
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
            choice = Choice(job, i, own, next(self.seq_ids), state)
            job.choices.append(choice)
            self.running[choice.sid] = choice
            self.admission.admit(choice.sid, job.grow)
        job.admitted = True
        self.jobs.append(job)
        job.outbox.append(Started(len(job.ids), self._cached_prefix(job)))

    def _cached_prefix(self, job: Job) -> int:
        try:
            if job.images is not None:  # the prompt as the cache knows it: its images' hashes in it
                return int(self.backend.cached_prefix(job.ids, images=job.images))
            if adapters := job.job.params.adapters:  # an adapter's KV is its own (``mlx_adapters.marked``)
                return int(self.backend.cached_prefix(job.ids, adapters=adapters))
            return int(self.backend.cached_prefix(job.ids))
        except Exception:  # a report, never a reason to fail the job
            log.exception("model %s: looking up the prefix cache failed", self.backend.model_id)
            return 0

    def start(self) -> None:
        """Admitted jobs whose routes have had ``Started`` (and stayed) enter the engine."""
        for job in self.jobs:
            if job.inserted:
                continue
            job.inserted = True
            self.events.append(GenerationBegan(job.job.request_id, self.backend.model_id))
            first, *others = job.choices
            try:
                job.cached = self._insert(job, first)
            except Exception:
                self._fail(job, self._logged("starting request %d failed", job.job.request_id))
                continue
            for choice in job.choices:
                choice.state.cached = choice.state.prefilled = job.cached
            # the first report, before any chunk is read (what the cache already holds)
            job.outbox.append(Progress(len(job.ids), job.cached, job.cached, time.monotonic() - first.state.began))
            if others:
                self.forks[first.sid] = others

    def _insert(self, job: Job, choice: Choice) -> int:
        if job.images is not None:
            return self.backend.insert(choice.sid, job.ids, choice.params, images=job.images)
        return self.backend.insert(choice.sid, job.ids, choice.params)

    # --- how a job ends ----------------------------------------------------------------------

    def _finish(self, choice: Choice) -> None:
        job, state = choice.job, choice.state
        assert state.stop_reason is not None
        inject("stop")
        if choice.index == 0:
            inject("prefix-cache store")
        # Its KV goes back to the prefix cache (raising: _fail); of several choices only the
        # first's, so one request's siblings do not push other conversations out of it.
        self.backend.remove(choice.sid, keep_cache=choice.index == 0)
        self._release(choice)
        now = time.monotonic()
        first = state.prefill_end or now
        job.outbox.append(Finished(
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            stop_sequence=state.stops.matched,
            prompt_tokens=len(job.ids),
            completion_tokens=state.new_tokens,
            cached_tokens=job.cached,
            index=choice.index,
            prefill_seconds=first - state.began,
            decode_seconds=now - first,
        ))
        if not self._live(job):
            self._end(job, None, state.stop_reason)

    def _logged(self, what: str, request_id: int, *, exc_info: object = True) -> GenerationFailed:
        """The error a client gets for an internal failure: an id, and a log line (with the
        traceback) that shows the same id."""
        error = GenerationFailed.new()
        log.error("model %s: " + what + " (error id %s)", self.backend.model_id, request_id,
                  error.error_id, exc_info=exc_info)
        self.events.append(JobFault(self.backend.model_id, error.error_id))
        return error

    def _fail(self, job: Job, error: GenerationFailed, *, removed: bool = False) -> None:
        """Something one of the job's sequences did raised: the job fails, alone."""
        self._stop(job, "Error", remove=not removed, keep_cache=False)
        self._end(job, Failed(error), "Error")

    def _gone(self, job: Job) -> None:
        """The route stopped listening: stop every choice, keep what their KV caches hold."""
        if not job.admitted:
            self.waiting.remove(job)
            self.events.append(generated(job, self.backend.model_id, "Cancelled"))
            job.close = True
            self.ended.append(job)
            return
        self._stop(job, "Cancelled")
        self._end(job, None, "Cancelled")

    def _stop(self, job: Job, reason: StopReason, *, remove: bool = True, keep_cache: bool = True) -> None:
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

    def _live(self, job: Job) -> list[Choice]:
        """The job's choices still in the batch."""
        return [c for c in job.choices if c.sid in self.running]

    def _release(self, choice: Choice) -> None:
        self.running.pop(choice.sid, None)
        self.forks.pop(choice.sid, None)
        self.admission.release(choice.sid)

    def _end(self, job: Job, last: Reply | None, reason: StopReason) -> None:
        self.events.append(generated(job, self.backend.model_id, reason))
        if last is not None:
            job.outbox.append(last)
        job.close = True
        if job in self.jobs:
            self.jobs.remove(job)
        self.ended.append(job)

    def shut(self) -> None:
        """Shutdown (or the loop itself broke): every job here gets its documented end."""
        for job in list(self.jobs):
            self._stop(job, "Shutdown", remove=False)  # the engine goes with the thread
            self._end(job, Failed(ShuttingDown()), "Shutdown")
        while self.waiting:
            job = self.waiting.popleft()
            self.events.append(generated(job, self.backend.model_id, "Shutdown"))
            job.outbox.append(Failed(ShuttingDown()))
            job.close = True
            self.ended.append(job)

    # --- what the crossings carry ------------------------------------------------------------

    def outgoing(self) -> tuple[list[Job], list[News], list[object]]:
        """Every job's news for the next crossing (its outbox emptied), and the events."""
        self._note_batch_state()
        jobs = [*self.ended, *self.jobs, *self.waiting]
        news: list[News] = [(j.job.reply, j.outbox, j.close) for j in jobs]
        events, self.events, self.ended = self.events, [], []
        for j in jobs:
            j.outbox = []
        return jobs, news, events

    def departed(self, jobs: list[Job], gone: list[int]) -> None:
        """The routes of ``jobs[i]`` for each ``i`` in ``gone`` had left by the crossing."""
        for i in gone:
            if not jobs[i].close:
                self._gone(jobs[i])

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
