"""How much host RAM is free to take: the KV pool's size on CPU and the host tier's default size read it."""

from __future__ import annotations

import ctypes
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


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the kernel (glibc's malloc_trim), once loading is done: parsing a
    tokenizer.json of a 150k-token vocabulary (the tokenizers library) frees ~40 MB that would otherwise stay resident
    for the process's life, measured in its RSS. Nothing happens on a libc without malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
