"""KVPool: the free list and the page slots."""

from __future__ import annotations

import sys

import pytest
import torch

from radixserve.cache.kv_pool import KVPool


def make_pool(num_pages: int = 8, page_size: int = 4) -> KVPool:
    return KVPool(
        num_layers=2, num_pages=num_pages, page_size=page_size, num_kv_heads=2, head_dim=3, dtype=torch.float32
    )


def test_alloc_free_roundtrip() -> None:
    pool = make_pool(8)
    assert pool.capacity == 7 and pool.num_free_pages == 7
    a = pool.alloc(3)
    b = pool.alloc(4)
    assert a is not None and b is not None
    assert len(set(a) | set(b)) == 7 and pool.num_free_pages == 0
    pool.free(a)
    assert pool.num_free_pages == 3
    c = pool.alloc(3)
    assert c is not None and sorted(c) == sorted(a)


def test_page_zero_never_handed_out() -> None:
    pool = make_pool(5)
    pages = pool.alloc(4)
    assert pages is not None and 0 not in pages and sorted(pages) == [1, 2, 3, 4]
    pool.free(pages)
    again = pool.alloc(4)
    assert again is not None and 0 not in again


def test_alloc_beyond_free_takes_nothing() -> None:
    pool = make_pool(6)
    assert pool.alloc(3) is not None
    assert pool.alloc(3) is None
    assert pool.num_free_pages == 2
    assert pool.alloc(2) is not None


def test_double_free_and_bad_ids_raise() -> None:
    pool = make_pool(6)
    pages = pool.alloc(2)
    assert pages is not None
    pool.free(pages[:1])
    with pytest.raises(RuntimeError):
        pool.free(pages[:1])
    with pytest.raises(RuntimeError):
        pool.free([0])
    with pytest.raises(RuntimeError):
        pool.free([6])


def test_too_small_pool_rejected() -> None:
    with pytest.raises(ValueError):
        make_pool(1)


def test_store_writes_the_right_slots() -> None:
    pool = make_pool(6, page_size=4)
    loc = torch.tensor([2 * 4 + 1, 3 * 4 + 3, 5 * 4 + 0])  # page 2 offset 1, page 3 offset 3, page 5 offset 0
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    v = -k
    pool.store(1, loc, k, v)
    assert torch.equal(pool.k_buffers[1][2, 1], k[0])
    assert torch.equal(pool.k_buffers[1][3, 3], k[1])
    assert torch.equal(pool.v_buffers[1][5, 0], v[2])
    # Nothing else was written, and the other layer is untouched.
    assert int((pool.k_buffers[1] != 0).sum()) == k.numel()
    assert int((pool.v_buffers[1] != 0).sum()) == v.numel()
    assert not pool.k_buffers[0].any() and not pool.v_buffers[0].any()


def test_store_casts_to_pool_dtype() -> None:
    pool = KVPool(1, 4, 2, 1, 2, dtype=torch.float16)
    pool.store(0, torch.tensor([3]), torch.ones(1, 1, 2, dtype=torch.float32), torch.ones(1, 1, 2, dtype=torch.float32))
    assert pool.k_buffers[0].dtype == torch.float16 and pool.k_buffers[0][1, 1].tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize(
    ("dtype", "rows"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
)
def test_a_float_pool_on_cpu_stores_with_one_op(dtype: torch.dtype, rows: torch.dtype) -> None:
    """bfloat16 and float32 pools on CPU copy a step's K and V rows with radixserve_kernels/cpu/kv_store.cpp's store_kv
    (one op a layer where two index_copy_ ran), float32 rows into bfloat16 pages too: the same bytes in the same slots
    (float32 rounded as torch rounds them); a slot outside the pool raises."""
    import radixserve_kernels.cpu

    if radixserve_kernels.cpu.ops() is None:
        pytest.skip("no C++ toolchain: the CPU kernels cannot be built")
    pool, ref = KVPool(2, 6, 4, 2, 64, dtype), KVPool(2, 6, 4, 2, 64, dtype)
    assert pool._store_rows is not None and pool.store_op(rows) == "rows"
    ref._store_rows = None  # the index_copy_ path
    torch.manual_seed(0)
    loc, k, v = torch.tensor([9, 15, 20]), torch.randn(3, 2, 64).to(rows), torch.randn(3, 2, 64).to(rows)
    if rows == torch.float32:  # halfway cases (to even), an infinity, a finite value rounding up to infinity
        k[0, 0, :5] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("inf"), 3.4e38])
    pool.store(1, loc, k, v)
    ref.store(1, loc, k, v)
    for ours, theirs in zip(pool.k_buffers + pool.v_buffers, ref.k_buffers + ref.v_buffers):
        assert torch.equal(ours, theirs)
    with pytest.raises(RuntimeError, match="not a pool slot"):
        pool.store(0, torch.tensor([24]), k[:1], v[:1])


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_cpu_pool_reads_zero_and_costs_no_memory_until_written() -> None:
    """Zeroed lazily by the kernel (an anonymous mapping), not by writing every byte at start-up."""
    before = _rss_bytes()
    pool = KVPool(4, 4097, 16, 2, 64, torch.bfloat16)  # 4 layers x K/V x 16.8 MB = 134 MB
    assert _rss_bytes() - before < 16 << 20
    pool.k_buffers[1][3] = 1.5
    assert torch.all(pool.k_buffers[1][3] == 1.5)
    assert all(int(b.count_nonzero()) == (16 * 2 * 64 if b is pool.k_buffers[1] else 0) for b in pool.k_buffers)
    assert all(int(b.count_nonzero()) == 0 for b in pool.v_buffers)
