"""KV pool: preallocated K and V pages for every layer, and the free list of page ids."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable
from typing import Any

import torch

from radixserve.cache.kv_format import KVFormat, dtype_name

# (activations, pages) that store_kv narrows as it copies: float32 rows into bfloat16 pages.
_NARROWED = (torch.float32, torch.bfloat16)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer. On CPU it is a private anonymous mapping, which the kernel zero-fills a page at a time on
    first touch: `torch.zeros` wrote every byte of a 0.75 GiB pool at start-up (1.8 s) and made it all resident
    before any request; the pool still reads as zeros everywhere (the padding sink page included)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _store_op(name: str) -> Any | None:
    """radixserve_kernels/cpu/kv_store.cpp's op `name`, or None where the CPU kernels are off or do not build."""
    import radixserve_kernels.cpu  # deferred: building the CPU kernels is a cost only pools on CPU pay

    ops = radixserve_kernels.cpu.ops()
    return None if ops is None else getattr(ops, name)


class KVPool:
    """`k_buffers[layer]` / `v_buffers[layer]` are `[num_pages, page_size, kv_heads, key_width]` /
    `[..., value_width]` of `dtype`, the storage type of the KV format (radixserve/cache/kv_format.py): both widths
    are head_dim for a float format; for int8 each is head_dim plus its scales' bytes (rows end with a float16 scale
    per group of values: 16 for keys, the whole row for values, so the widths differ).

    Page 0 is the padding sink: it is never handed out, so padded page-table entries may point at it.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_format: KVFormat | None = None,
    ) -> None:
        """`dtype` is the model's (what attention computes in); `kv_format` how pages store K and V (None: as
        `dtype`)."""
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.format = kv_format or KVFormat(dtype_name(dtype))
        self.compute_dtype = dtype
        self.dtype = self.format.storage
        self.format.check_head_dim(head_dim)
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.key_width, self.value_width = self.format.key_width(head_dim), self.format.value_width(head_dim)
        shape = (num_pages, page_size, num_kv_heads)
        self.k_buffers = [_zeros((*shape, self.key_width), self.dtype, self.device) for _ in range(num_layers)]
        self.v_buffers = [_zeros((*shape, self.value_width), self.dtype, self.device) for _ in range(num_layers)]
        # int8 on CPU: our fused quantize-and-store op where the CPU kernels build (bit-identical to the format's
        # torch encoder, which runs elsewhere): the torch expression is ~20 small ops per layer and step.
        self._store_int8 = _store_op("store_kv_int8") if self.format.scaled and self.device.type == "cpu" else None
        # bfloat16 / float32 on CPU: one op copies a step's K and V rows (two index_copy_ and their dispatch a layer).
        plain = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        self._store_rows = _store_op("store_kv") if plain and not self.format.scaled else None
        # Popping from the end hands out low page ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the sink)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages, or None (taking nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; a bad or repeated id raises before anything is freed."""
        pages = list(pages)
        if len(set(pages)) != len(pages) or any(p <= 0 or p >= self.num_pages or self._is_free[p] for p in pages):
            raise RuntimeError(f"double free or bad page id among {pages}")
        for p in pages:
            self._is_free[p] = True
        self._free.extend(pages)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v `[T, kv_heads, head_dim]` into flat slots `loc` (int64, = page * page_size + offset), encoded
        in the pool's format (int8 quantizes here, as the KV is stored).

        index_copy_ into the flat slot views: cheaper than advanced indexing (on CPU above all) and free of host
        syncs, so it is also safe inside a CUDA-graph capture."""
        kb, vb = self.k_buffers[layer_id], self.v_buffers[layer_id]
        op = self.store_op(k.dtype) if k.dtype == v.dtype else None
        if op == "int8":
            self._store_int8(k, v, kb, vb, loc)  # rotates the rows itself
            return
        if op == "rows":
            self._store_rows(k, v, kb, vb, loc)
            return
        k, v = self.format.rotate(k), self.format.rotate_values(v)  # int8: rows are stored rotated (kv_format.py)
        kb.view(-1, *kb.shape[2:]).index_copy_(0, loc, self.format.encode(k, "k"))
        vb.view(-1, *vb.shape[2:]).index_copy_(0, loc, self.format.encode(v, "v"))

    def store_op(self, dtype: torch.dtype) -> str | None:
        """The C++ op `store` writes k and v of `dtype` with: "int8" (store_kv_int8), "rows" (store_kv: rows of the
        pool's dtype, or float32 rows into bfloat16 pages), or None (the format's torch expression)."""
        if self._store_int8 is not None and dtype in (torch.float32, torch.bfloat16):
            return "int8"
        if self._store_rows is not None and (dtype == self.dtype or (dtype, self.dtype) == _NARROWED):
            return "rows"
        return None

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in this pool, over all layers (scales included)."""
        return self.format.bytes_per_token(len(self.k_buffers), self.k_buffers[0].shape[2], self.head_dim)

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """`[n, layers, page_size, kv_heads, key_width + value_width]` copies of pool pages `pages` (int64, on the
        pool's device): each KV head's stored key row then its value row, as they are (int8 with their scales), what
        the host and disk tiers store per page. K and V side by side on the last dim rather than stacked, because
        int8 key and value rows differ in width; the KV heads stay one dim, which tensor-parallel shards split."""
        k = torch.stack([b.index_select(0, pages) for b in self.k_buffers], 1)
        v = torch.stack([b.index_select(0, pages) for b in self.v_buffers], 1)
        return torch.cat([k, v], -1)

    def scatter_pages(self, pages: torch.Tensor, kv: torch.Tensor) -> None:
        """The inverse of `gather_pages`: write `kv` `[n, layers, page_size, kv_heads, key_width + value_width]` (on
        the pool's device) into pool pages `pages`."""
        kw = self.key_width
        for layer, (kb, vb) in enumerate(zip(self.k_buffers, self.v_buffers)):
            kb.index_copy_(0, pages, kv[:, layer, ..., :kw].contiguous())
            vb.index_copy_(0, pages, kv[:, layer, ..., kw:].contiguous())

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page as `gather_pages` returns it: `[layers, page_size, kv_heads, key_width + value_width]`."""
        return (len(self.k_buffers), *self.k_buffers[0].shape[1:3], self.key_width + self.value_width)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K and V at flat slots `src` to flat slots `dst` in every layer (int64, on the pool's device): one
        gather and one scatter per buffer, reading only the slots named. All are read before any is written. Stored
        rows move as they are: an int8 row keeps its scale, so a copy never re-quantizes."""
        for buf in (*self.k_buffers, *self.v_buffers):
            flat = buf.view(-1, *buf.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V one token takes in the pool, over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
