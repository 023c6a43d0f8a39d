"""Stored responses of `/v1/responses` (`store`, `previous_response_id`, retrieve and delete), in memory.

A stored response keeps its response object and the whole conversation it ended (input and output, as chat
messages), so a client may send only its new turn; the prompt built from it renders the old turns exactly as
before, and the radix cache serves their KV. Bounded three ways, the oldest dropped first: at most
`MAX_RESPONSES` (1024) responses, each for `TTL_S` (one hour) after it was stored, and `MAX_BYTES` (256 MiB) of
conversation in all. Each is filed under its tenant's namespace: another key's id is a 404 like a missing one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from radixserve.server.protocol import ChatMessage
from radixserve.server.responses_protocol import ResponseObject

MAX_RESPONSES = 1024
TTL_S = 3600.0
MAX_BYTES = 256 * 1024 * 1024


@dataclass
class Stored:
    response: ResponseObject
    conversation: list[ChatMessage]  # every message up to and including this response's output
    size: int
    at: float


class ResponseStore:
    def __init__(
        self,
        max_responses: int = MAX_RESPONSES,
        ttl_s: float = TTL_S,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()  # (tenant, id), oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, tenant: str, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        size = len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return  # larger than the whole store: keeping it would drop everything else
        with self._lock:
            self._drop((tenant, response.id))
            self._items[(tenant, response.id)] = Stored(response, conversation, size, self.clock())
            self._bytes += size
            self._expire()
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, tenant: str, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._items.get((tenant, response_id))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop((tenant, response_id))

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._items:
            key, first = next(iter(self._items.items()))
            if first.at > cutoff:
                return
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> bool:
        gone = self._items.pop(key, None)
        if gone is None:
            return False
        self._bytes -= gone.size
        return True
