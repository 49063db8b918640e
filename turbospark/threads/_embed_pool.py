"""Which inputs the encoder's next forward pass runs (sans-io).

Theory of operation.  Every embedding request (a job) brings one or more inputs, each already
tokenised to a length.  The encoder thread keeps the inputs not yet run in this pool and asks it,
before every forward pass, for the next batch:

- Inputs are grouped by length bucket (the smallest power of two, at least ``MIN_BUCKET``, that
  holds them).  A batch is padded to its longest input, so putting inputs of one bucket together
  wastes at most half of the padded work, however mixed the lengths that arrive.
- The candidates are visited round-robin over the jobs, oldest job first: every job's first
  pending input, then every job's second, and so on.  The first candidate chooses the bucket;
  the batch is the first ``max_batch`` candidates of that bucket.  So a small request that arrives
  while a 2,048-input request is being worked through rides in the very next batch of its bucket
  instead of waiting for the whole of the big one, and inputs of one job run in their own order.
- ``remove`` forgets a job (its client left, or it failed): its inputs never run.

Nothing here knows about Trio, threads or MLX; ``encoder_thread`` drives it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["MIN_BUCKET", "EmbeddingPool", "bucket_of"]

MIN_BUCKET = 16


def bucket_of(length: int) -> int:
    """The length bucket of an input of ``length`` tokens."""
    bucket = MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


class EmbeddingPool:
    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        # per job, in arrival order: its pending inputs as (index, length), in index order
        self._jobs: dict[Hashable, list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        """Inputs waiting to run."""
        return sum(len(inputs) for inputs in self._jobs.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._jobs

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    def add(self, key: Hashable, lengths: Sequence[int]) -> None:
        """A job's inputs, by index; a job with none is not kept."""
        if key in self._jobs:
            raise ValueError("job already in the pool")
        if lengths:
            self._jobs[key] = [(i, n) for i, n in enumerate(lengths)]

    def remove(self, key: Hashable) -> None:
        self._jobs.pop(key, None)

    def next_batch(self) -> list[tuple[Hashable, int]]:
        """The next forward pass: up to ``max_batch`` (job, input index) pairs of one bucket,
        taken out of the pool.  Empty when nothing waits."""
        if not self._jobs:
            return []
        queues = list(self._jobs.items())
        deepest = max(len(inputs) for _, inputs in queues)
        bucket: int | None = None
        chosen: dict[Hashable, list[int]] = {}  # job -> positions in its pending list
        batch: list[tuple[Hashable, int]] = []
        for rank in range(deepest):
            for key, inputs in queues:
                if rank >= len(inputs):
                    continue
                index, length = inputs[rank]
                if bucket is None:
                    bucket = bucket_of(length)
                elif bucket_of(length) != bucket:
                    continue
                chosen.setdefault(key, []).append(rank)
                batch.append((key, index))
                if len(batch) == self.max_batch:
                    break
            if len(batch) == self.max_batch:
                break
        for key, ranks in chosen.items():
            taken = set(ranks)
            left = [item for rank, item in enumerate(self._jobs[key]) if rank not in taken]
            if left:
                self._jobs[key] = left
            else:
                del self._jobs[key]
        return batch
