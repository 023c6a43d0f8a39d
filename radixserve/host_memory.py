"""How much host RAM is free to take: the KV pool's size on CPU and the host tier's default size read it."""

from __future__ import annotations

import os


def available_ram() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
