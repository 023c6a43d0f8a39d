"""A request's KV page list that remembers where it last changed (see radixserve/scheduler/page_rows.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, SupportsIndex

CLEAN = sys.maxsize  # `changed_from` when nothing changed since the last copy


class PageList(list[int]):
    """A request's KV pages: a list that records the lowest index any mutation touched (`changed_from`) since it
    was last copied into page-table row `row`."""

    __slots__ = ("changed_from", "row")

    def __init__(self, pages: Iterable[int] = ()) -> None:
        super().__init__(pages)
        self.changed_from = 0
        self.row = -1

    def _touch(self, i: int) -> None:
        self.changed_from = min(self.changed_from, i)

    def _index(self, i: SupportsIndex | slice) -> int:
        if isinstance(i, slice):
            return i.indices(len(self))[0]  # a slice assignment may change the length: all after its start moves
        j = i.__index__()
        return max(j + len(self), 0) if j < 0 else j

    def append(self, page: int) -> None:
        self._touch(len(self))
        super().append(page)

    def extend(self, pages: Iterable[int]) -> None:
        self._touch(len(self))
        super().extend(pages)

    def __iadd__(self, pages: Iterable[int]) -> PageList:  # type: ignore[override, misc]
        self.extend(pages)
        return self

    def insert(self, i: SupportsIndex, page: int) -> None:
        self._touch(min(self._index(i), len(self)))
        super().insert(i, page)

    def __setitem__(self, i: Any, value: Any) -> None:
        self._touch(self._index(i))
        super().__setitem__(i, value)

    def __delitem__(self, i: SupportsIndex | slice) -> None:
        self._touch(self._index(i))
        super().__delitem__(i)

    def pop(self, i: SupportsIndex = -1) -> int:
        self._touch(self._index(i))
        return super().pop(i)

    def remove(self, page: int) -> None:
        self._touch(self.index(page))
        super().remove(page)

    def clear(self) -> None:
        self._touch(0)
        super().clear()

    def __imul__(self, n: SupportsIndex) -> PageList:  # type: ignore[override, misc]
        self._touch(0)
        return super().__imul__(n)

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._touch(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._touch(0)
        super().reverse()


class PageListField:
    """Descriptor for `Req.pages`: whatever list is assigned is kept as a PageList (a new one: changed from 0)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return ()  # the dataclass default: __init__ assigns it, and __set__ makes a fresh PageList of it
        return obj.__dict__[self.attr]

    def __set__(self, obj: Any, value: Iterable[int]) -> None:
        obj.__dict__[self.attr] = PageList(value)
