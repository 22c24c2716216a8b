"""The heap a server starts with, set aside from the garbage collector.

CPython's collector scans every tracked object of a generation it collects, and a full
(generation 2) collection scans them all: the modules, classes, functions and tables a server
imports and builds before its first request, some 60,000 objects for `rollout serve`, besides
what the requests create. They live as long as the process, yet each full collection walks
them again: 20-35 ms of a stalled event loop on a 2-vCPU VM, every connection waiting.
`freeze_startup_heap()` collects what is garbage once, then moves every surviving object to
the permanent generation (`gc.freeze()`), which collections skip. Later collections scan only
what the server made since.

It is called by `serve()` once the server is warmed up (`ServerConfig.freeze_heap`, set by
`rollout serve` and its workers), not by the engine: freezing is a decision about a whole
process, which an application embedding the engine makes for itself. Objects frozen stay
until the process ends, even if they become garbage; the startup heap does not.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect, then freeze what survives; returns the objects now in the permanent
    generation."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
