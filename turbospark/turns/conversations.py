"""Recent responses kept for ``previous_response_id`` (sans-io).

A stored response holds the conversation that produced it (its input turns after the request's
instructions) with its own output appended as the assistant's turn, so a follow-up continues the
same text and the model's prefix cache finds it.  A response that continues another stores only
its own turns (the new input and its output) and points at the one it continues, so a chain of k
turns costs O(k), not O(k²): its conversation is the chain's turns, read back to front.

The store is bounded by bytes (each response's body and own turns, as JSON) and by entries; the
least recently stored goes first, but never the newest.  A response keeps the ones it continues
alive, deleted or evicted, because its conversation needs them: the bytes counted are those of
every response still reachable from the store, each counted once.  Everything runs on the Trio
thread, so there is nothing to lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import attrs

__all__ = ["ResponseStore", "StoredResponse"]


@attrs.define(eq=False)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was sent
    turns: tuple[dict[str, Any], ...]  # its own turns: the new input, then its output
    parent: StoredResponse | None = None  # the response it continues
    size: int = attrs.field(init=False)
    holders: int = attrs.field(default=0, init=False)  # the store's entry, and the responses continuing it

    def __attrs_post_init__(self) -> None:
        self.size = len(json.dumps([self.body, self.turns], default=str))

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        """The whole conversation, this response's output included."""
        chain: list[tuple[dict[str, Any], ...]] = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node.turns)
            node = node.parent
        return tuple(turn for turns in reversed(chain) for turn in turns)


class ResponseStore:
    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0  # of every response reachable from the entries, each once
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self.delete(response_id)
        self._hold(entry)
        self._entries[response_id] = entry
        while len(self._entries) > 1 and (self.bytes > self.max_bytes or len(self._entries) > self.max_entries):
            _, oldest = self._entries.popitem(last=False)
            self._release(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._release(entry)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _hold(self, node: StoredResponse | None) -> None:
        while node is not None:
            node.holders += 1
            if node.holders > 1:
                return  # already counted, and its parent held for it
            self.bytes += node.size
            node = node.parent

    def _release(self, node: StoredResponse | None) -> None:
        while node is not None:
            node.holders -= 1
            if node.holders > 0:
                return
            self.bytes -= node.size
            node = node.parent
