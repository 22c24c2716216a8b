"""`EventStream.serve`: an SSE response's frames go through a bounded outbox to a writer, so
the work does not wait on the socket, and what is queued together is sent together."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine._http_stream import EventStream

pytestmark = pytest.mark.trio

DEADLINE = 5.0


class Peer:
    """The ASGI side: records each message; while `held` is set, a body write waits (a client
    that does not read)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.held = False
        self.released = trio.Event()
        self.disconnect = trio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if self.held and message["type"] == "http.response.body":
            await self.released.wait()
        self.messages.append(message)

    async def receive(self) -> dict[str, Any]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


async def test_frames_queued_together_go_out_with_the_headers_in_one_write() -> None:
    peer = Peer()
    stream = EventStream(peer.send, lambda: [(b"server-timing", b"x")])
    order: list[str] = []

    async def work() -> None:
        await stream.frame(b"created\n\n")
        await stream.frame(b"in_progress\n\n")
        order.append(f"queued with {len(peer.messages)} messages sent")
        await trio.testing.wait_all_tasks_blocked()  # the model request: the writer writes
        await stream.frame(b"delta\n\n")

    with trio.fail_after(DEADLINE):
        assert await stream.serve(peer.receive, work()) is None
        assert await stream.end() == 200
    assert order == ["queued with 0 messages sent"]  # the work did not wait on the socket
    assert peer.messages[0]["type"] == "http.response.start"
    assert (b"server-timing", b"x") in peer.messages[0]["headers"]
    assert peer.bodies() == [b"created\n\nin_progress\n\n", b"delta\n\n", b""]
    assert peer.messages[-1]["more_body"] is False


async def test_the_work_waits_only_once_the_outbox_is_full() -> None:
    peer = Peer()
    peer.held = True  # the client reads nothing
    stream = EventStream(peer.send, max_buffered_bytes=100)
    queued: list[int] = []

    async def work() -> None:
        for i in range(10):
            await stream.frame(b"x" * 30)
            queued.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, peer.receive, work())
        await trio.testing.wait_all_tasks_blocked()
        # Three frames (90 bytes) fit in 100, and the writer took them as one write, which
        # waits: their room is not free until it is written, and the fourth waits for it.
        assert queued == [0, 1, 2]
        assert peer.bodies() == []
        peer.held = False
        peer.released.set()
    with trio.fail_after(DEADLINE):
        assert await stream.end() == 200
    assert b"".join(peer.bodies()) == b"x" * 300


async def test_a_disconnect_cancels_the_work_and_the_writer() -> None:
    peer = Peer()
    peer.held = True
    stream = EventStream(peer.send, max_buffered_bytes=10)
    cancelled: list[bool] = []

    async def work() -> None:
        try:
            while True:
                await stream.frame(b"x" * 8)
        except trio.Cancelled:
            cancelled.append(True)
            raise

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.serve, peer.receive, work())
            await trio.testing.wait_all_tasks_blocked()
            peer.disconnect.set()
    assert cancelled == [True]


async def test_frames_after_serve_are_written_inline() -> None:
    peer = Peer()
    stream = EventStream(peer.send)

    async def nothing() -> None:
        pass

    with trio.fail_after(DEADLINE):
        await stream.serve(peer.receive, nothing())
        assert not stream.started
        await stream.frame(b"data: [DONE]\n\n")
        assert peer.bodies() == [b"data: [DONE]\n\n"]
        assert await stream.end() == 200
