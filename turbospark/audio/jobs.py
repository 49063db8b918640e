"""The async audio jobs' store (sans-io): ids, lifecycle and bounds.

A job is ``running`` until its work ends ``succeeded`` (its result bytes and content type kept)
or ``failed`` (its error kept), or until a DELETE makes it ``cancelled``.  At most ``MAX_UNFINISHED``
jobs run at once; finished jobs are kept ``KEEP_SECONDS``; results take at most ``MAX_RESULT_BYTES``
in all (the oldest succeeded results are evicted first).  Time is passed in, never read here.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Literal

import attrs

__all__ = ["Job", "JobStore", "KEEP_SECONDS", "MAX_RESULT_BYTES", "MAX_UNFINISHED", "Status"]

MAX_UNFINISHED = 8
KEEP_SECONDS = 3600.0
MAX_RESULT_BYTES = 256 * 1024 * 1024

Status = Literal["running", "succeeded", "failed", "cancelled"]
STATUSES: tuple[Status, ...] = ("running", "succeeded", "failed", "cancelled")


@attrs.define(eq=False)
class Job:
    id: str
    kind: str  # transcription | generation
    model: str
    created: int  # unix seconds
    started: float  # the store's clock
    status: Status = "running"
    finished: float | None = None
    result: bytes = b""
    content_type: str = ""
    error_status: int = 0
    error_message: str = ""

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.id, "object": "audio.job", "kind": self.kind, "model": self.model,
            "status": self.status, "created": self.created,
        }  # fmt: skip
        if self.status == "succeeded":
            out["result_url"] = f"/v1/audio/jobs/{self.id}/result"
        if self.status == "failed":
            out["error"] = {"status": self.error_status, "message": self.error_message}
        return out


class JobStore:
    def __init__(
        self,
        *,
        max_unfinished: int = MAX_UNFINISHED,
        keep_seconds: float = KEEP_SECONDS,
        max_result_bytes: int = MAX_RESULT_BYTES,
    ) -> None:
        self.max_unfinished = max_unfinished
        self.keep_seconds = keep_seconds
        self.max_result_bytes = max_result_bytes
        self._jobs: dict[str, Job] = {}

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs.values())

    def get(self, job_id: str, now: float) -> Job | None:
        self.expire(now)
        return self._jobs.get(job_id)

    def unfinished(self) -> int:
        return sum(1 for j in self._jobs.values() if j.status == "running")

    def has_room(self) -> bool:
        return self.unfinished() < self.max_unfinished

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for job in self._jobs.values():
            out[job.status] += 1
        return out

    def running_for(self, model: str) -> int:
        return sum(1 for j in self._jobs.values() if j.status == "running" and j.model == model)

    def add(self, kind: str, model: str, *, created: int, now: float) -> Job:
        """A new running job (the caller checked ``has_room``)."""
        if not self.has_room():
            raise RuntimeError("no room for another unfinished job")
        job = Job(f"job_{secrets.token_hex(8)}", kind, model, created, now)
        self._jobs[job.id] = job
        return job

    def succeed(self, job: Job, result: bytes, content_type: str, now: float) -> None:
        if job.status != "running":
            return  # cancelled meanwhile: the result is discarded
        job.status, job.finished, job.result, job.content_type = "succeeded", now, result, content_type
        self._evict()

    def fail(self, job: Job, status: int, message: str, now: float) -> None:
        if job.status != "running":
            return
        job.status, job.finished, job.error_status, job.error_message = "failed", now, status, message

    def cancel(self, job: Job, now: float) -> None:
        if job.status == "running":
            job.status, job.finished = "cancelled", now

    def remove(self, job: Job) -> None:
        self._jobs.pop(job.id, None)

    def expire(self, now: float) -> None:
        for job in list(self._jobs.values()):
            if job.finished is not None and now - job.finished > self.keep_seconds:
                del self._jobs[job.id]

    def _evict(self) -> None:
        done = [j for j in self._jobs.values() if j.status == "succeeded"]
        total = sum(len(j.result) for j in done)
        for job in sorted(done, key=lambda j: j.finished or 0.0):
            if total <= self.max_result_bytes:
                break
            total -= len(job.result)
            del self._jobs[job.id]
