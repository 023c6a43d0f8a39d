"""What the automatic host tier costs an engine on CUDA: build a `HostTier` of each size on a CUDA pool, time its
pinned allocation and its `release()`, and read torch's pinned bytes held after (0 when release empties the cache).

    PYTHONPATH=$PWD:$PWD/tests python3 -m benchmarks.gpu.host_tier_probe 4 32 32     # sizes in GiB
"""

from __future__ import annotations

import sys
import time

import torch

from radixserve.cache.host_tier import HostTier
from radixserve.cache.kv_pool import KVPool
from radixserve.host_memory import available_ram
from test_kv_tier import LAYOUT, PS  # a two-layer page layout; the buffer's size is what is measured


def pinned_bytes_held() -> int | str:
    try:
        return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", "?")
    except (AttributeError, RuntimeError) as e:  # older torch has no host statistics
        return repr(e)[:60]


def main(sizes_gib: list[int]) -> None:
    pool = KVPool(LAYOUT.num_layers, 16, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16, device="cuda")
    print(f"torch {torch.__version__}, available {available_ram() / 2**30:.1f} GiB, held {pinned_bytes_held()}")
    for gib in sizes_gib:
        t = time.perf_counter()
        tier = HostTier(gib << 30, LAYOUT, pool)
        built = time.perf_counter() - t
        pinned, during = tier.buf.is_pinned(), pinned_bytes_held()
        t = time.perf_counter()
        tier.release()
        released = time.perf_counter() - t
        print(
            f"HostTier {gib} GiB: pinned {pinned}, init {built:.2f} s, release {released:.2f} s, "
            f"held during {during} after {pinned_bytes_held()}, available {available_ram() / 2**30:.1f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 32])
