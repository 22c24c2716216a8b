"""permessage-deflate (RFC 7692) on the WebSocket, on or off per server.

hypercorn (0.17, 0.18) hands `[PerMessageDeflate()]` to every WebSocket handshake
(`Handshake.accept` in `hypercorn/protocol/ws_stream.py`) and has no setting to turn it off: a
client that offers the extension, as the openai SDK's `websockets` client and Codex do, always
gets it, and every frame is then compressed by the sender and inflated by the receiver.

`ServerConfig.websocket_deflate` decides per server. Off, the upgrade request reaches
hypercorn's handshake without its `permessage-deflate` offers (other extension offers, which
hypercorn never accepts anyway, are left as they are): the handshake answers with no
`Sec-WebSocket-Extensions` header and frames travel uncompressed. The client sees an ordinary
server that does not support the extension (RFC 7692 section 5: the server may decline). The
ASGI scope's headers are the filtered ones, so the app sees the request as negotiated.

The mechanism is one idempotent patch of hypercorn's `WSStream.handle` (the entry point of every
WebSocket stream, HTTP/1.1 and HTTP/2 alike), inert unless the server's hypercorn config is a
`HypercornConfig` with `websocket_deflate = False`; other servers in the process keep hypercorn's
behaviour. `tests/test_websocket_deflate.py` pins what this relies on (hypercorn still offers
the extension to every handshake, and the request's headers are what its handshake reads), so
an upgrade of hypercorn that changes either fails a test instead of silently compressing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hypercorn.config import Config

__all__ = [
    "DEFAULT_WEBSOCKET_DEFLATE",
    "HypercornConfig",
    "decline_deflate_offers",
    "without_deflate_offers",
]

# Whether `rollout serve` accepts permessage-deflate when a client offers it. Off: measured
# with `rollout bench` on loopback (bench/README.md), deflate made every WebSocket turn slower
# (+0.5 ms to the first event with 2.7 KB messages, +1.7 ms with 16 KB ones, mostly zlib
# compressing the client's message) and cost the server about a third more CPU per streamed
# event; it pays for itself only where the link, not the CPU, is the limit (below ~50 Mbit/s
# for 16 KB messages on the same machine), or where bytes are billed.
DEFAULT_WEBSOCKET_DEFLATE = False

EXTENSIONS_HEADER = b"sec-websocket-extensions"
DEFLATE = b"permessage-deflate"


class HypercornConfig(Config):
    """hypercorn's configuration plus rollout's switch for permessage-deflate (see the module
    docstring); True is hypercorn's own behaviour."""

    websocket_deflate: bool = True
    # Write each chunk with one system call when the socket takes it (`rollout.engine._write`).
    direct_writes: bool = True
    # rollout's transport bounds (`rollout.engine._http_limits`); None: hypercorn's behaviour.
    transport: Any = None  # a TransportLimits
    transport_stats: Any = None  # a TransportStats, which the app's /metrics reads
    websocket_inflate: Any = None  # an InflateLimits (`rollout.engine._ws_deflate`)


def without_deflate_offers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request headers with every `permessage-deflate` offer removed from
    `Sec-WebSocket-Extensions` (the header dropped when nothing else is offered)."""
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name.lower() == EXTENSIONS_HEADER:
            offers = [o.strip() for o in value.split(b",")]
            kept = [o for o in offers if o and o.split(b";")[0].strip().lower() != DEFLATE]
            if not kept:
                continue
            value = b", ".join(kept)
        out.append((name, value))
    return out


def decline_deflate_offers() -> None:
    """Make hypercorn's WebSocket streams honour `HypercornConfig.websocket_deflate = False`.
    Idempotent; streams of servers configured otherwise are untouched."""
    from hypercorn.protocol.events import Request
    from hypercorn.protocol.ws_stream import WSStream

    original = WSStream.handle
    # our mark on the function we patched
    if getattr(original, "_rollout_patched", False):
        return
    if "headers" not in {field.name for field in dataclasses.fields(Request)}:
        raise RuntimeError(
            "hypercorn's Request event has no `headers`: rollout's --no-websocket-deflate "
            "needs updating for this hypercorn version"
        )

    async def handle(self: WSStream, event: Any) -> None:
        # our setting on hypercorn's Config (a plain Config lacks it)
        if isinstance(event, Request) and not getattr(self.config, "websocket_deflate", True):
            event = dataclasses.replace(event, headers=without_deflate_offers(event.headers))
        await original(self, event)

    handle._rollout_patched = True  # type: ignore[attr-defined]
    WSStream.handle = handle  # type: ignore[method-assign]
