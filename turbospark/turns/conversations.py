"""Recent responses kept for ``previous_response_id`` (sans-io).

A stored response holds the conversation that produced it (its input turns after the request's
instructions) with its own output appended as the assistant's turn, so a follow-up continues the
same text and the model's prefix cache finds it.  The store is bounded in entries; the oldest
goes first.  Everything runs on the Trio thread, so there is nothing to lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

__all__ = ["ResponseStore", "StoredResponse"]


@attrs.frozen
class StoredResponse:
    body: dict[str, Any]  # the response object as it was sent
    messages: tuple[dict[str, Any], ...]  # the conversation, this response's output included


class ResponseStore:
    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
