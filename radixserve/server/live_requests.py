"""The /generate requests running, by the key that sent each and the client's rid label: what /abort_request
(radixserve/server/abort_api.py) looks requests up in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LiveRequests:
    """The /generate requests running: per engine request, the key that sent it and the client's rid label."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[str, str | None]] = {}  # engine rid -> (key name, client rid)

    @contextmanager
    def track(self, owner: str, pairs: list[tuple[str | None, str]]) -> Iterator[None]:
        """While the block runs, each (client rid, engine rid) of `pairs` can be aborted by `owner`."""
        for label, rid in pairs:
            self._live[rid] = (owner, label)
        try:
            yield
        finally:
            for _, rid in pairs:
                self._live.pop(rid, None)

    def find(self, owner: str | None, label: str | None) -> list[str]:
        """Engine rids sent by `owner` (None: anyone) with the client rid `label` (None: any)."""
        return [
            rid
            for rid, (who, lab) in self._live.items()
            if (owner is None or who == owner) and (label is None or lab == label)
        ]
