"""Stored responses for the Responses API's ``previous_response_id`` (``serve.responses_store_mib``).

A response created with ``store`` (the API's default) is kept in process memory with the
conversation that produced it: the input items of its whole chain (the predecessor's
conversation, then its own input) and its output items, in the Responses API's item shapes.
A follow-up that names it continues that conversation: the server prepends those items to its
``input`` (``instructions`` are not carried over, as OpenAI's API does not carry them).

Bounded by size: each entry is charged the length of its items and response serialised as
JSON (UTF-8 bytes); when the total passes the bound, the least recently used entries go first.
An entry larger than the whole bound is not kept. A response whose id is not (or no longer)
here gets a 400 naming ``previous_response_id``. Nothing is written to disk: a restart forgets
every response, as the docs say.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    """One stored response: ``items`` (the conversation: every input item of its chain, then
    its output items) and ``response`` (the response object as it was answered)."""

    items: list[dict[str, Any]]
    response: dict[str, Any]
    size_bytes: int


class ResponseStore:
    """An LRU map response id -> :class:`StoredResponse`, at most ``max_bytes`` in all
    (0: nothing is kept). Thread-safe; values are deep copies, so callers may change what
    they get back."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0  # entries dropped to stay within max_bytes (logs, tests)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, items: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """Keep ``response`` and its conversation ``items``; returns False when it is larger
        than the whole store (then nothing is kept)."""
        size = len(json.dumps(items, ensure_ascii=False).encode()) + len(
            json.dumps(response, ensure_ascii=False).encode()
        )
        if size > self.max_bytes:
            return False
        entry = StoredResponse(copy.deepcopy(items), copy.deepcopy(response), size)
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size_bytes
            self._entries[response_id] = entry
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size_bytes
                self.evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored entry (a copy; marked most recently used), or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
        return StoredResponse(copy.deepcopy(entry.items), copy.deepcopy(entry.response), entry.size_bytes)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is None:
                return False
            self._bytes -= entry.size_bytes
            return True
