"""The scheduler's kept page table (scheduler/page_rows.py): after any sequence of list mutations, slot changes and
reassignments, a step's gathered rows equal the table built from the page lists afresh (zero-padded)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.forward_batch import ForwardBatch
from radixserve.page_list import CLEAN, PageList
from radixserve.request import Req
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.page_rows import PageRows


def fresh_table(pages: list[list[int]]) -> torch.Tensor:
    return ForwardBatch.build([[]] * len(pages), [0] * len(pages), pages, 1, []).page_table


def mutate(pages: PageList, rng: random.Random) -> None:
    """One of the ways the scheduler (or a future change) may edit a request's pages."""
    op = rng.randrange(9)
    new = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 4))]
    n = len(pages)
    if op == 0:
        pages.append(new[0])
    elif op == 1:
        pages.extend(new)
    elif op == 2 and n:
        pages[: rng.randrange(n + 1)] = new  # what the cache's insert does to a prefix (it may change the length)
    elif op == 3 and n:
        del pages[rng.randrange(n) :]  # a speculative rollback
    elif op == 4 and n:
        pages[rng.randrange(-n, n)] = new[0]
    elif op == 5:
        pages += new
    elif op == 6 and n:
        pages.pop(rng.randrange(-n, n))
    elif op == 7:
        pages.insert(rng.randrange(-n - 1, n + 2), new[0])
    elif op == 8 and n:
        pages.remove(pages[rng.randrange(n)])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_gathered_rows_equal_a_fresh_table(seed: int) -> None:
    rng = random.Random(seed)
    slots = 6
    rows = PageRows(slots, width=2)  # small, so that the table grows too
    lists: dict[int, PageList] = {s: PageList() for s in range(slots)}
    for _ in range(40):
        for s in rng.sample(range(slots), rng.randrange(1, slots + 1)):
            if rng.random() < 0.1:
                lists[s] = PageList(rng.randrange(1, 1000) for _ in range(rng.randrange(5)))  # the slot changed hands
            else:
                for _ in range(rng.randrange(3)):
                    mutate(lists[s], rng)
        if rng.random() < 0.1:  # two requests trade slots: each row must be copied whole
            a, b = rng.sample(range(slots), 2)
            lists[a], lists[b] = lists[b], lists[a]
        step = rng.sample(range(slots), rng.randrange(1, slots + 1))
        got = rows.gather(step, [lists[s] for s in step])
        assert torch.equal(got, fresh_table([list(lists[s]) for s in step]))


def test_a_request_keeps_its_pages_as_a_page_list() -> None:
    params = SamplingParams()
    req = Req("r", [1, 2, 3], params, SamplingInfo(params, None, [], [1, 2, 3]))
    assert isinstance(req.pages, PageList) and req.pages == [] and req.pages.changed_from == 0
    req.pages.changed_from = CLEAN
    req.pages = [4, 5]  # an assigned list starts changed from its first page
    assert isinstance(req.pages, PageList) and req.pages == [4, 5] and req.pages.changed_from == 0
    other = Req("s", [1], params, req.sampling)
    assert other.pages is not req.pages


def test_a_gathered_table_is_a_copy() -> None:
    rows = PageRows(2)
    pages = PageList([3, 4])
    table = rows.gather([1], [pages])
    pages[0] = 9
    rows.gather([1], [pages])
    assert table.tolist() == [[3, 4]], "a step in flight must keep the rows it was built with"


@pytest.mark.parametrize("index", [slice(1, None), slice(None, None, 2), -1, 0])
def test_changed_from_is_the_lowest_touched_index(index: int | slice) -> None:
    pages = PageList([1, 2, 3, 4])
    pages.changed_from = CLEAN
    del pages[index]
    start = index.indices(4)[0] if isinstance(index, slice) else index % 4
    assert pages.changed_from == start
