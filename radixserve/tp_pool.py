"""The KV tiers' view of a tensor-parallel pool: whole pages (every KV head), each rank moving its own heads' shard.

Rank 0 owns the radix tree and the tiers (radixserve/cache/kv_tier.py), so every tier decision (what to spill, what
a prompt hits, what to load) is made once, there. Each rank's pool holds only its KV heads of a page; a page spilled
to the host or disk tier is gathered from every rank and stored whole, in the layout a single rank would write, and a
page loaded back is split by heads and each rank writes its part. Page files are therefore the same at any `--tp`,
restart-safe as on one rank (one index, one directory, rank 0's). The shards travel on the group's CPU control
channel (radixserve/distributed.py): a transfer is one header and page-id broadcast, then one gather or scatter.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.distributed import PageTransfer, TPGroup
from radixserve.model.parallel import plan_shard

HEADS_DIM = -2  # pages are [n, layers, page_size, kv_heads, key row + value row] (KVPool.gather_pages)


class ShardedPool:
    """Rank 0's pool as the tiers see it: `gather_pages` / `scatter_pages` move whole pages across the ranks; every
    other attribute (alloc, free, capacity, device, dtype, page_size ...) is rank 0's pool's, since page ids mean
    the same pages on every rank."""

    def __init__(self, pool: KVPool, tp: TPGroup, config: ModelConfig) -> None:
        self.pool = pool
        self.tp = tp
        # Where each rank's heads sit among the model's (ranks may hold copies of a KV head when tp > KV heads).
        self.heads = [(s.kv_start, s.num_kv_heads) for s in (plan_shard(config, tp.size, r) for r in range(tp.size))]
        self.num_kv_heads = config.num_kv_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Whole pages `[n, layers, page_size, all KV heads, key row + value row]` on rank 0's device."""
        local = self.pool.gather_pages(pages).cpu().contiguous()
        shards = self.tp.gather_pages(pages.cpu(), local)
        shape = (*local.shape[:HEADS_DIM], self.num_kv_heads, local.shape[-1])
        out = torch.empty(shape, dtype=local.dtype)
        for (start, count), shard in zip(self.heads, shards):
            out[..., start : start + count, :] = shard
        return out.to(self.pool.device)

    def scatter_pages(self, pages: torch.Tensor, kv: torch.Tensor) -> None:
        """Write whole pages `kv` into pool pages `pages` on every rank, each taking its heads."""
        cpu = kv.cpu()
        shards = [cpu[..., start : start + count, :].contiguous() for start, count in self.heads]
        self.tp.scatter_pages(pages.cpu(), shards)
        self.pool.scatter_pages(pages, shards[0].to(self.pool.device))


def serve_transfer(pool: KVPool, tp: TPGroup, transfer: PageTransfer) -> None:
    """A rank above 0: its side of one page transfer rank 0 started (ShardedPool)."""
    pages = transfer.pages.to(pool.device)
    if transfer.gather:
        tp.send_shard(pool.gather_pages(pages).cpu().contiguous())
        return
    shape = (pages.numel(), *pool.page_shape)
    pool.scatter_pages(pages, tp.recv_shard(shape, pool.dtype).to(pool.device))
