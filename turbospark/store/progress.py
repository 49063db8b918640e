"""How store work tells how far it is: progress bars on stderr (``turbospark models``), and a
callback that hears each step (the server streaming Ollama's ``/api/pull``).

A :class:`Progress` is handed down explicitly to every call that downloads, reads, copies or
converts bytes; there is no ambient hook (global or thread-local) to set around a call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import attrs
from tqdm import tqdm

__all__ = ["QUIET", "Progress", "Report", "progress_from"]

#: ``report(status, completed, total)``: a step and, where known, how many of its bytes are done.
Report = Callable[[str, int | None, int | None], None]

_T = TypeVar("_T")


@attrs.frozen
class Progress:
    """Where store work says how far it is: ``bars`` on stderr, and the ``report`` callback."""

    bars: bool = False
    report: Report | None = None

    def __call__(self, status: str, completed: int | None = None, total: int | None = None) -> None:
        """Tell the callback, if any, how far ``status`` is (byte counts where known)."""
        if self.report is not None:
            self.report(status, completed, total)

    def bytes_bar(self, *, total: int | None, desc: str) -> tqdm:
        """A byte bar on stderr (a silent one without ``bars``); the caller updates it."""
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not self.bars, leave=False)

    def each(self, items: Iterable[_T], *, desc: str, unit: str) -> Iterator[_T]:
        """``items``, with a bar over them on stderr when ``bars`` is set."""
        return iter(tqdm(items, desc=desc, unit=unit, disable=not self.bars, leave=False))


#: No bars, no callback.
QUIET = Progress()


def progress_from(progress: bool | Progress) -> Progress:
    """A :class:`Progress` from what a caller passed: ``True`` or ``False`` (bars or none) or one."""
    return progress if isinstance(progress, Progress) else Progress(bars=progress)
