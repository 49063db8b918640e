"""The encoder thread: embedding jobs batched across requests, and its crossings into Trio.

One pinned OS thread per embedding model builds the encoder (MLX streams are thread-local), then
loops:

    while True:
        check_cancelled()   # shutdown: stop before the next forward pass
        exchange()          # ONE crossing: finished jobs' vectors out, leaving clients and
                            # new jobs in (waiting only when nothing is pending)
        accept()            # new jobs: tokenised here, their inputs join the pool; if any came,
        exchange()          # one more crossing: refusals out, and who left, before the pass
        forward()           # the pool's next batch (model/_embed_pool.py): up to max_batch
                            # inputs of one length bucket, from any number of jobs

- A forward pass runs inputs of many requests at once, padded to the longest and masked, so an
  input's vector is what it would be alone.  A job is answered, in one ``Vectors`` message, when
  its last input has run.
- Who left: in each crossing, a job whose route has closed its reply channel
  (``statistics().open_receive_channels == 0``) leaves the pool; its inputs not yet run never
  run.  Every crossing comes right before a forward pass, so a request that disconnects is
  dropped before its batch runs (an input already in the pass that is running is the bound).
- It never waits on a client: a job's one answer fits its reply channel's buffer.
- A job's failure is its own: an input too long to read without truncation answers that job
  400; a tokeniser that raises fails that job alone.  A forward pass that raises fails the jobs
  whose inputs it held (500 "embedding failed"; the traceback goes to the log) and the thread
  keeps serving.
- Shutdown (the actor's scope cancelled): every job on the thread is answered ``ShuttingDown``
  in one last crossing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable

import attrs
import numpy as np
import trio

from ..errors import GenerationFailed, RequestInvalid, ShuttingDown, TurboSparkError, inject
from ..messages import EmbeddingBatch, Embedded, EmbeddingJob, EmbeddingOutcome, EmbeddingReply, Failed, JobFault, Vectors
from ._embed_pool import EmbeddingPool
from .model_thread import deliver
from ..model.encoder import Encoder

__all__ = ["EmbeddingLimits", "serve_encoder"]

log = logging.getLogger("turbospark.model")

#: ``take(count, wait)``: up to ``count`` jobs from the actor's inbox (None once it is closed).
TakeJobs = Callable[[int, bool], Awaitable["list[EmbeddingJob] | None"]]


@attrs.frozen
class EmbeddingLimits:
    max_batch: int  # inputs per forward pass
    max_jobs: int  # jobs the thread holds at once; more wait in the actor's inbox


def serve_encoder(
    make_encoder: Callable[[], Encoder],
    take: TakeJobs,
    emit: Callable[[object], None],
    ready: Callable[[Encoder], None],
    limits: EmbeddingLimits,
) -> None:
    """Body of an encoder thread: load, say ready, then run batches until shutdown."""
    encoder = make_encoder()
    trio.from_thread.run_sync(ready, encoder)
    _Loop(encoder, take, emit, limits).run()


@attrs.define(eq=False)
class _Job:
    job: EmbeddingJob
    vectors: np.ndarray
    left: int
    prompt_tokens: int = 0
    ids: list[list[int]] = attrs.field(factory=list)
    outbox: list[EmbeddingReply] = attrs.field(factory=list)
    close: bool = False


def _answer(entry: _Job, cross: bool) -> Vectors:
    """A job's vectors; a rerank job's scores, by cosine similarity when no cross-encoder made
    them (the vectors are unit vectors: the query's is first)."""
    if entry.job.query is None or cross:
        return Vectors(entry.vectors, entry.prompt_tokens)
    scores = entry.vectors[1:] @ entry.vectors[0]
    return Vectors(scores[:, None].astype(np.float32), entry.prompt_tokens, by_similarity=True)


_News = tuple[trio.MemorySendChannel[EmbeddingReply], list[EmbeddingReply], bool]


class _Loop:
    def __init__(self, encoder: Encoder, take: TakeJobs, emit: Callable[[object], None], limits: EmbeddingLimits) -> None:
        self.encoder = encoder
        self.take = take
        self.emit = emit
        self.limits = limits
        self.pool = EmbeddingPool(limits.max_batch)
        self.jobs: dict[Hashable, _Job] = {}  # in the pool, by identity
        self.ended: list[_Job] = []  # with their answer still to deliver
        self.events: list[object] = []
        self.queue_open = True

    def run(self) -> None:
        try:
            while True:
                trio.from_thread.check_cancelled()
                want = self.limits.max_jobs - len(self.jobs) if self.queue_open else 0
                taken = self._exchange(want, wait=not self.jobs)
                if taken is None:
                    self.queue_open = False  # the inbox closed: shutdown is under way
                elif taken:
                    for job in taken:
                        self._accept(job)
                    self._exchange(0, wait=False)  # refusals out, departures in, before the pass
                if not self.jobs and not self.queue_open:
                    self._exchange(0, wait=False)
                    return
                if batch := self.pool.next_batch():
                    self._forward(batch)
        except BaseException:
            self._shutdown()
            raise

    # --- jobs ------------------------------------------------------------------------------

    def _accept(self, job: EmbeddingJob) -> None:
        cross = getattr(self.encoder, "cross", False)
        similarity = job.query is not None and not cross  # the query's vector, then the documents'
        count = len(job.inputs) + similarity
        entry = _Job(job, np.zeros((count, self.encoder.dimensions), np.float32), count)
        try:
            if job.query is None and cross:
                raise RequestInvalid(
                    f"{self.encoder.model_id} is a cross-encoder: it scores pairs (/v1/rerank, "
                    "/v1/score) and makes no embeddings", param="model",
                )
            if job.query is not None and cross:
                entry.ids = self.encoder.tokenize_pairs(job.query, job.inputs, truncate=job.truncate)  # type: ignore[attr-defined]
            elif similarity:
                entry.ids = self.encoder.tokenize((job.query, *job.inputs), truncate=job.truncate)  # type: ignore[arg-type]
            else:
                entry.ids = self._tokenize(job)
            if not job.truncate:
                limit = self.encoder.max_tokens
                for i, ids in enumerate(entry.ids):
                    if len(ids) > limit:
                        raise RequestInvalid(
                            f"input {i} is {len(ids)} tokens long, more than this model's limit of "
                            f"{limit}; shorten it or let it be truncated",
                            param="input",
                        )
            entry.prompt_tokens = sum(len(ids) for ids in entry.ids)
        except Exception as exc:
            if not isinstance(exc, TurboSparkError):
                exc = GenerationFailed.new("embedding failed")
                log.exception("model %s: tokenising request %d failed (error id %s)",
                              self.encoder.model_id, job.request_id, exc.error_id)
                self.events.append(JobFault(self.encoder.model_id, exc.error_id, "encoder"))
            self._end(entry, Failed(exc), "Error")
            return
        if not job.inputs:
            self._end(entry, Vectors(entry.vectors, 0), "Done")
            return
        self.jobs[entry] = entry
        self.pool.add(entry, [len(ids) for ids in entry.ids])

    def _tokenize(self, job: EmbeddingJob) -> list[list[int]]:
        """Each input's ids: texts through the model's tokenizer, ids as given, checked against
        its vocabulary (cut to what the model reads, like a text, when truncating)."""
        texts = [x for x in job.inputs if isinstance(x, str)]
        tokenized = iter(self.encoder.tokenize(texts, truncate=job.truncate) if texts else ())
        vocab = getattr(self.encoder, "vocab_size", None)
        out: list[list[int]] = []
        for i, x in enumerate(job.inputs):
            if isinstance(x, str):
                out.append(next(tokenized))
                continue
            if not x:
                raise RequestInvalid(f"input {i} is an empty list of token ids", param="input")
            if vocab is not None and (bad := next((t for t in x if not 0 <= t < vocab), None)) is not None:
                raise RequestInvalid(
                    f"input {i} holds token id {bad}, outside this model's vocabulary (0-{vocab - 1})",
                    param="input")
            out.append(list(x[: self.encoder.max_tokens] if job.truncate else x))
        return out

    def _end(self, entry: _Job, last: EmbeddingReply | None, outcome: EmbeddingOutcome) -> None:
        self.pool.remove(entry)
        self.jobs.pop(entry, None)
        job = entry.job
        self.events.append(Embedded(
            id=job.request_id, model=self.encoder.model_id, inputs=len(job.inputs),
            computed=max(0, len(job.inputs) - entry.left), prompt_tokens=entry.prompt_tokens,
            seconds=time.monotonic() - job.created, outcome=outcome,
        ))
        if last is not None:
            entry.outbox.append(last)
        entry.close = True
        self.ended.append(entry)

    # --- the forward pass ------------------------------------------------------------------

    def _forward(self, batch: list[tuple[Hashable, int]]) -> None:
        inputs = [self.jobs[key].ids[index] for key, index in batch]
        began = time.monotonic()
        try:
            inject("encoder batch")
            vectors = self.encoder.embed(inputs)
            if vectors.shape != (len(batch), self.encoder.dimensions):
                raise ValueError(f"the encoder gave {vectors.shape} vectors for {len(batch)} inputs")
        except Exception:
            owners = {key for key, _ in batch}
            error = GenerationFailed.new("embedding failed")
            log.exception("model %s: a forward pass failed; its %d jobs fail with it (error id %s)",
                          self.encoder.model_id, len(owners), error.error_id)
            self.events.append(JobFault(self.encoder.model_id, error.error_id, "encoder"))
            for key in owners:
                self._end(self.jobs[key], Failed(error), "Error")
            return
        longest = max(len(ids) for ids in inputs)
        self.events.append(EmbeddingBatch(
            model=self.encoder.model_id, inputs=len(batch), jobs=len({key for key, _ in batch}),
            tokens=sum(len(ids) for ids in inputs), padded_tokens=longest * len(batch),
            seconds=time.monotonic() - began,
        ))
        for row, (key, index) in enumerate(batch):
            entry = self.jobs[key]
            entry.vectors[index] = vectors[row]
            entry.left -= 1
            if entry.left == 0:
                self._end(entry, _answer(entry, getattr(self.encoder, "cross", False)), "Done")

    # --- the crossing ----------------------------------------------------------------------

    def _exchange(self, want: int, *, wait: bool) -> list[EmbeddingJob] | None:
        """Deliver what ended, drop the jobs whose routes left (one crossing), and take up to
        ``want`` new jobs (waiting for one with ``wait``)."""
        entries = [*self.ended, *self.jobs.values()]
        news: list[_News] = [(e.job.reply, e.outbox, e.close) for e in entries]
        events, self.events, self.ended = self.events, [], []
        for e in entries:
            e.outbox = []
        if want > 0:
            gone, taken = trio.from_thread.run(self._trio_exchange, events, news, want, wait)
        else:
            gone, taken = trio.from_thread.run_sync(self._deliver, events, news), []
        for i in gone:
            if not entries[i].close:
                self._end(entries[i], None, "Cancelled")
        return taken

    def _deliver(self, events: list[object], news: Iterable[_News]) -> list[int]:
        return deliver(self.emit, events, news)

    async def _trio_exchange(
        self, events: list[object], news: list[_News], want: int, wait: bool
    ) -> tuple[list[int], list[EmbeddingJob] | None]:
        gone = self._deliver(events, news)
        return gone, await self.take(want, wait)

    def _shutdown(self) -> None:
        """Cancelled (or the loop itself broke): every job here is answered ``ShuttingDown``."""
        for entry in list(self.jobs.values()):
            self._end(entry, Failed(ShuttingDown()), "Shutdown")
        try:
            news = [(e.job.reply, e.outbox, e.close) for e in self.ended]
            trio.from_thread.run_sync(self._deliver, self.events, news)
        except BaseException:  # the Trio side is gone already; nothing more can be said
            log.debug("model %s: final answers could not be delivered", self.encoder.model_id)
