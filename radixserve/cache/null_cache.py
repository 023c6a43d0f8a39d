"""The prefix cache when caching is off (`enable_radix_cache=False`): the same interface as RadixCache, holding
nothing, so the scheduler has one code path and every page a request computes stays private to it."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.radix_cache import InsertResult, MatchResult


class NullCache:
    enabled = False  # the scheduler neither orders admissions by cached prefix nor holds back shared prefixes
    total_pages = evictable_pages = protected_pages = retained_pages = 0
    tier = None  # no second tier either

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        return MatchResult(node=None, pages=[], num_tokens=0)  # type: ignore[arg-type]

    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: str = "") -> InsertResult:
        return InsertResult(node=None, pages=[])  # type: ignore[arg-type]  (nothing enters: the pages stay private)

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def retain(self, node: object, retention: object) -> bool:
        return False

    def reset(self) -> None:
        pass

    def flush_namespaces(self, accept: object) -> int:
        return 0

    def check_invariants(self) -> None:
        pass
