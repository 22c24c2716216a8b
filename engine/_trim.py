"""Freed memory given back to the operating system after WebSocket connections were cut off.

A connection cut off for not reading frees everything it held (its outbox, the frames its
responses waited to queue, the responses' own state) when it ends, but glibc's allocator keeps
most of those pages for later allocations instead of returning them: measured with 5 stalled
connections of 16 lanes each (the 1M-token sim), Python's own accounting (`tracemalloc`) went
back to within 0.3 MiB of where it was, while the process's RSS stayed 127 MiB up. Reused
later, that memory is not a leak, but a server that just shed an attack would look (and be
accounted, by an orchestrator's memory limit) as if it still held it. `malloc_trim(0)` returns
it: 127 MiB in 16 ms here.

So once a cut-off connection has ended, `release_freed_memory()` trims the C heap, at most once
per `MEMORY_TRIM_INTERVAL` (the connections cut off meanwhile wait for the next trim, which
returns their memory too; the wait happens in the ended connection's own task, after its
socket is gone and its place released). A C library without `malloc_trim` (musl, macOS) makes
it a no-op. Process-wide state, as the heap is.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable

import trio

__all__ = ["MEMORY_TRIM_INTERVAL", "release_freed_memory"]

# The least time (seconds) between two trims: one costs ~16 ms of the event loop per 100 MiB
# returned, so a stream of cut-offs costs at most ~2% of it.
MEMORY_TRIM_INTERVAL = 1.0

_last_trim = -math.inf  # time.monotonic() of the last trim (the process's, not a trio clock)
_pending = False  # a connection waits to trim


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    return trim


_malloc_trim = _find_malloc_trim()


async def release_freed_memory() -> None:
    """Give freed memory back to the OS, now or once `MEMORY_TRIM_INTERVAL` has passed since
    the last trim (at once if another caller is already waiting for that one)."""
    global _last_trim, _pending
    if _malloc_trim is None or _pending:
        return
    _pending = True
    try:
        wait = _last_trim + MEMORY_TRIM_INTERVAL - time.monotonic()
        if wait > 0:
            await trio.sleep(wait)
    finally:
        _pending = False
    _last_trim = time.monotonic()
    _malloc_trim(0)
