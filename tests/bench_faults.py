"""A `rollout serve` process with a fault injected, for the benchmark's tests (never shipped).

    python -m tests.bench_faults [--drop-every N]

serves the usual app (in-memory store, a free loopback port, printed as its base URL on the
first line of stdout) wrapped in `DropEveryNthDelta`: on every WebSocket connection it drops
every N-th `output_text.delta` / `function_call_arguments.delta` frame and renumbers the
events after it, so the stream stays well-formed (no sequence gap for a client to notice)
while tokens go missing: the fault a benchmark that trusts nominal sizes would not see.
`--drop-every 0` serves the app unchanged (the same process, for the control run).
It stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from rollout.engine._app import RolloutApp
from rollout.engine._serve import ServerConfig, serve

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DELTAS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


class DropEveryNthDelta:
    """ASGI wrapper: the app's WebSocket frames, less every `n`-th delta of the connection,
    with the sequence numbers of a response's later events moved down to close the gap."""

    def __init__(self, app: RolloutApp, n: int) -> None:
        self.app = app
        self.n = n

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        deltas = 0
        dropped = 0  # of the current response's events

        async def faulty_send(message: Message) -> None:
            nonlocal deltas, dropped
            text = message.get("text")
            if message["type"] != "websocket.send" or text is None:
                await send(message)
                return
            event = json.loads(text)
            kind = event.get("type")
            if kind == "response.created":
                dropped = 0
            if kind in DELTAS:
                deltas += 1
                if deltas % self.n == 0:
                    dropped += 1
                    return
            if dropped and isinstance(event.get("sequence_number"), int):
                event["sequence_number"] -= dropped
                text = json.dumps(event, separators=(",", ":"))
            await send({"type": "websocket.send", "text": text})

        await self.app(scope, receive, faulty_send)


async def _main(drop_every: int) -> None:
    def wrapper(app: RolloutApp) -> Any:
        return DropEveryNthDelta(app, drop_every) if drop_every > 0 else app

    config = ServerConfig(port=0, data_dir=None, app_wrapper=wrapper)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, config)
        print(url, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench_faults")
    parser.add_argument("--drop-every", type=int, default=10, help="0: no fault")
    args = parser.parse_args(argv)
    trio.run(_main, args.drop_every)
    sys.exit(0)


if __name__ == "__main__":
    main()
