"""The C heap of a long-lived server process: give freed memory back to the system.

CPython allocates a large `bytes` (an upload's 1 MiB chunk, say) with the C library's
`malloc`. glibc's `malloc` serves blocks over its mmap threshold with their own mappings,
returned at `free`, but it raises that threshold to the size of any such block freed (up to
32 MiB), so after the first few chunks every later one comes from a heap arena, and a freed
arena page stays in the process: 40 stalled uploads of 40 MiB left the broker 430 MB over its
idle size after all of them were gone (`bench.upload_memory`). `map_large_blocks` fixes the
threshold (which also stops glibc from raising it), so such blocks always have mappings of
their own and go back to the system when freed; `release_free_memory` asks glibc to hand the
arenas' free pages back (`malloc_trim`). Elsewhere (musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 256 * 1024
"""Blocks this large or larger get mappings of their own (glibc's default start is 128 KiB)."""
_M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number (malloc.h)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def map_large_blocks(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Give every C heap block of `threshold_bytes` or more a mapping of its own, returned to
    the system when freed (glibc's `mallopt(M_MMAP_THRESHOLD)`; for the whole process, so
    only an entry point calls it). False where the C library has no such call."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    if not mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)):
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) failed", threshold_bytes)
        return False
    return True


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim(0)`, which
    walks every arena: a few milliseconds on a large heap, so call it when a burst of large
    allocations is over, not per allocation). False where the C library has no such call."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True
