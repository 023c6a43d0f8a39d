"""Continuation index over the radix tree: for the last few tokens of a request, the tokens that followed the same
n-gram in a sequence the tree holds (drafts for speculative decoding).

It indexes the tree's pages by their pool page ids, which are unique in the tree and never change while a page is
there (a node split keeps them; hashed keys could collide), so it follows the tree page by page: `add_run` when an
insert creates pages, `remove` when eviction frees them, `clear` on reset. Every page registers the n-grams that end just before each of its tokens (the first
ones reach back into the parent page), namespaced like the tree, so drafts never cross cache namespaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

GRAM = 3  # tokens looked up: a shorter key matches too much to be worth a draft
MAX_MATCH = 16  # how far back a candidate's match is measured
CANDIDATES = 4  # most recent occurrences of a gram compared per lookup


@dataclass(slots=True)
class _Page:
    namespace: str
    tokens: tuple[int, ...]
    parent: int | None  # the page before (None: the first page of its namespace)
    children: list[int] = field(default_factory=list)  # pages that followed it, latest last
    grams: list[tuple[int, ...]] = field(default_factory=list)  # the grams this page registered


@dataclass
class TreeDraft:
    match: int  # trailing tokens of the query found before the continuation (at most MAX_MATCH)
    tokens: list[int]


class ContinuationIndex:
    def __init__(self) -> None:
        self._pages: dict[int, _Page] = {}
        # (namespace, gram) -> {page: offsets of the tokens the gram precedes in that page}, pages in insertion order
        self._grams: dict[tuple[str, tuple[int, ...]], dict[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def pages(self) -> set[int]:
        return set(self._pages)

    def add_run(self, namespace: str, parent: int | None, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Index new consecutive pages (`tokens` holds len(pages) full pages) following page `parent`."""
        if not pages:
            return
        ps = len(tokens) // len(pages)
        before = self._tail(parent, GRAM)
        prev = parent if parent in self._pages else None
        for i, key in enumerate(pages):
            page_tokens = tuple(tokens[i * ps : (i + 1) * ps])
            page = _Page(namespace, page_tokens, prev)
            ctx = before + list(page_tokens)
            for off in range(ps):
                end = len(before) + off  # the gram ends just before page token `off`
                if end >= GRAM:
                    gram = tuple(ctx[end - GRAM : end])
                    slot = self._grams.setdefault((namespace, gram), {})
                    if key in slot:
                        slot[key].append(off)
                    else:
                        slot[key] = [off]
                        page.grams.append(gram)
            self._pages[key] = page
            if prev is not None:
                self._pages[prev].children.append(key)
            prev, before = key, ctx[-GRAM:]

    def _tail(self, page_id: int | None, n: int) -> list[int]:
        """The last n tokens up to and including page `page_id` (fewer at the start of a namespace)."""
        out: list[int] = []
        while page_id in self._pages and len(out) < n:
            page = self._pages[page_id]
            out = list(page.tokens) + out
            page_id = page.parent
        return out[-n:] if n else []

    def remove(self, pages: Sequence[int]) -> None:
        """Forget evicted pages (a leaf's tail first: children before parents)."""
        for key in reversed(pages):
            page = self._pages.pop(key, None)
            if page is None:
                continue
            for gram in page.grams:
                slot = self._grams.get((page.namespace, gram))
                if slot is not None:
                    slot.pop(key, None)
                    if not slot:
                        del self._grams[(page.namespace, gram)]
            parent = self._pages.get(page.parent) if page.parent is not None else None
            if parent is not None and key in parent.children:
                parent.children.remove(key)

    def clear(self) -> None:
        self._pages.clear()
        self._grams.clear()

    def lookup(self, namespace: str, context: Sequence[int], k: int) -> TreeDraft | None:
        """Up to k tokens that followed the longest-matching recent occurrence of context's last GRAM tokens."""
        if k <= 0 or len(context) < GRAM:
            return None
        slot = self._grams.get((namespace, tuple(context[-GRAM:])))
        if not slot:
            return None
        best: TreeDraft | None = None
        recent = [(key, off) for key in list(slot)[-CANDIDATES:] for off in slot[key]][-CANDIDATES:]
        for key, off in recent[::-1]:
            match = self._match_back(key, off, context)
            if best is None or match > best.match:
                tokens = self._continuation(key, off, k)
                if tokens:
                    best = TreeDraft(match, tokens)
        return best

    def _match_back(self, key: int, off: int, context: Sequence[int]) -> int:
        """How many trailing tokens of `context` equal the tokens before (key, off), up to MAX_MATCH."""
        n, page, i = 0, self._pages[key], off - 1
        limit = min(MAX_MATCH, len(context))
        while n < limit:
            while i < 0:
                if page.parent is None or page.parent not in self._pages:
                    return n
                page = self._pages[page.parent]
                i = len(page.tokens) - 1
            if page.tokens[i] != context[-1 - n]:
                return n
            n, i = n + 1, i - 1
        return n

    def _continuation(self, key: int, off: int, k: int) -> list[int]:
        """k tokens from (key, off) on, following the latest child at each page end."""
        out: list[int] = []
        page: _Page | None = self._pages[key]
        while page is not None and len(out) < k:
            out.extend(page.tokens[off : off + k - len(out)])
            off = 0
            page = self._pages.get(page.children[-1]) if page.children else None
        return out
