"""The startup heap set aside from the garbage collector (`engine/_heap.py`): `rollout serve`
freezes what it built before its first request, so a full collection later scans only what
the requests made (counted here in objects, the collector's work; the pause it saves is
measured in bench/README); a server embedded in someone else's process leaves their heap
alone. (The benchmark's own freezing is checked in tests/test_bench.py.)"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from rollout.engine._heap import freeze_startup_heap

from tests.client_harness import open_rollout_process
from tests.server_harness import open_test_server

DEADLINE = 60


@pytest.fixture
def thawed() -> Iterator[None]:
    """This test process's heap as it was: nothing frozen before, everything thawed after."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_freezing_leaves_a_full_collection_only_what_came_after(thawed: None) -> None:
    tracked = len(gc.get_objects())
    frozen = freeze_startup_heap()
    assert frozen >= tracked // 2  # what was alive (less the garbage collected first)
    made_after = [[n] for n in range(1000)]
    # What a full collection walks now: what was made since, not the frozen heap.
    assert len(gc.get_objects()) < len(made_after) + 2_000 < frozen


async def test_serve_freezes_only_when_asked(thawed: None) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server():
            assert gc.get_freeze_count() == 0  # an embedded server: the host's decision
        async with open_test_server(freeze_heap=True):
            frozen = gc.get_freeze_count()
            assert frozen > 10_000 and len(gc.get_objects()) < frozen


@pytest.mark.parametrize("workers", [1, 2])
async def test_rollout_serve_freezes_its_startup_heap(tmp_path: Path, workers: int) -> None:
    """In its one process, or in each of its workers."""
    with trio.fail_after(DEADLINE):
        async with open_rollout_process(
            data_dir=tmp_path, extra_args=["--log-level", "debug", "--workers", str(workers)]
        ) as server:
            said = [json.loads(line)["message"] for line in server.lines if line.startswith("{")]
    frozen = [m for m in said if m.endswith("objects of the startup heap frozen")]
    assert len(frozen) == workers, said
    assert all(int(m.split()[0]) > 10_000 for m in frozen), frozen
