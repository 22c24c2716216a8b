"""permessage-deflate with bounded inflation (`rollout serve --websocket-deflate`).

wsproto's `PerMessageDeflate` inflates each frame's payload whole (`decompress(data)`, no
`max_length`), and hypercorn bounds a message only after it has been inflated and buffered,
at its own limit (`websocket_max_message_size`, which rollout sets to twice the message limit
plus 1 MiB so that the app answers an oversized message with an error event). Deflate's ratio
reaches ~1,030: one 64 KB read inflates to ~64 MB, and 40 sockets each sending a 122 KB
compressed, unfinished message took a server from 212 MiB to 3.9 GB, held until the sockets
closed (measured: `bench/scripts/deflate_bomb.py`).

`BoundedPerMessageDeflate` inflates incrementally, `INFLATE_STEP` bytes at a time
(`zlib.Decompress.decompress(data, max_length)`), and stops before committing more:
- a message inflating past `max_message_size + INFLATE_MARGIN` (the app's own limit plus a
  margin, so a message just over the limit still gets the app's `message_too_large` error
  event) fails with 1009 (message too big) at that size;
- every connection's inflated bytes of its unfinished message count against one server-wide
  budget (`InflateBudget`, `--websocket-inflate-budget-mb`, default 256); a step that does not
  fit fails with 1013 (try again later), so no number of sockets inflates more than the
  budget at once. A message's bytes leave the budget when it is complete (hypercorn hands it
  to the app, whose queue is bounded), when its connection fails, or once its socket is
  closed (`InflateBudget` drops closed sockets' reservations when it runs short);
- the server inflates at most `InflatePace.bytes_per_second` (`--websocket-inflate-rate-mb`,
  default 64 MiB/s) across every connection: a connection whose last read inflated bytes past
  the pace waits before its next read (`_http_limits` awaits `InflatePace.wait` between
  reads), in turn (a FIFO lock), so compressed messages take at most a sixth of the event loop
  (inflating runs ~380 MiB/s on it here: 64 MiB of a bomb in 170 ms) and every other client is
  served between the steps. Measured (`tests/test_hostile_transport.py`, 40 sockets of a bomb
  at the default budget beside a client polling every 0.5 s): its worst latency 0.74-0.96 s
  unpaced on a quiet machine (1.5-2.3 s loaded), 21 ms paced.

Installed per connection as hypercorn's WebSocket handshake accepts it: `bound_inflation()`
replaces the `PerMessageDeflate` that hypercorn's `Handshake.accept` instantiates (a name of
`hypercorn.protocol.ws_stream`) with a factory reading the accepting stream's config from a
context variable that a patch of `WSStream._accept` sets for the duration of the handshake.
Servers whose hypercorn config has no `websocket_inflate` get wsproto's own extension. The
path (`WSStream._accept` calls `Handshake.accept`, which instantiates `PerMessageDeflate` from
its module's globals) is pinned by `tests/test_hostile_transport.py`.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import math
import weakref
import zlib
from typing import Any

import attrs
import trio
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol

__all__ = [
    "DEFAULT_INFLATE_BUDGET",
    "DEFAULT_INFLATE_RATE",
    "INFLATE_MARGIN",
    "INFLATE_STEP",
    "BoundedPerMessageDeflate",
    "InflateBudget",
    "InflateLimits",
    "InflatePace",
    "bound_inflation",
]

# Inflated bytes of unfinished messages the whole server holds at once: four messages at the
# 64 MiB limit. A burst of compressed messages past it is refused (1013), not buffered.
DEFAULT_INFLATE_BUDGET = 256 * 2**20
# Over the message limit, how far a message may inflate before the connection fails with
# 1009: enough for the app to see that it is too large and answer with its error event.
INFLATE_MARGIN = 1 << 20
# Bytes inflated per step: the most memory committed past the budget before it is seen (the
# message limit is never passed: a step stops one byte past it). As much as one 1 KiB read
# of a bomb inflates to (`_http_limits.INFLATE_READ`), so a read is one step, not joined
# from several (joining the pieces cost ~20% of the CPU a bomb takes).
INFLATE_STEP = 1 << 20
# Inflated bytes a second, the whole server: a sixth of what the event loop inflates at full
# speed here, and a 64 MiB message (the limit) in one second.
DEFAULT_INFLATE_RATE = 64 * 2**20
# Of that pace, how much may be spent ahead in a burst (seconds' worth): a message of a few
# MiB inflates without waiting.
INFLATE_BURST = 0.125

_accepting: contextvars.ContextVar[Any] = contextvars.ContextVar("rollout_ws_accepting")


class InflateBudget:
    """Inflated bytes of unfinished messages, server-wide, at most `max_bytes`."""

    def __init__(self, max_bytes: int, refusals: collections.Counter[str] | None = None) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        # Steps refused (connections failed with 1013), counted as `inflate_budget` (the
        # server's `TransportStats.refusals`).
        self.refusals = refusals if refusals is not None else collections.Counter()
        self._holders: dict[int, BoundedPerMessageDeflate] = {}

    def take(self, holder: BoundedPerMessageDeflate, size: int) -> bool:
        """Reserve `size` bytes for `holder`; False (nothing reserved) when they do not fit
        even after dropping the reservations of closed sockets."""
        if self.used + size > self.max_bytes:
            self._sweep()
            if self.used + size > self.max_bytes:
                self.refusals["inflate_budget"] += 1
                return False
        self.used += size
        holder.held += size
        self._holders[id(holder)] = holder
        return True

    def give_back(self, holder: BoundedPerMessageDeflate, size: int) -> None:
        """Release `size` bytes of what `holder` reserved."""
        size = min(size, holder.held)
        self.used -= size
        holder.held -= size

    def fail(self, holder: BoundedPerMessageDeflate) -> None:
        """`holder`'s connection failed: its message is dropped, but its last output stays
        referenced by wsproto's and hypercorn's event generators until hypercorn has
        handled the close, which awaits (other connections inflate meanwhile): those bytes
        stay reserved until the extension itself is freed with its connection."""
        keep = min(holder.last_output, holder.held)  # (the previous call's output)
        self.used -= holder.held - keep
        holder.held = 0
        self._holders.pop(id(holder), None)
        if keep:
            weakref.finalize(holder, self._free, keep)

    def _free(self, size: int) -> None:
        self.used -= size

    def release(self, holder: BoundedPerMessageDeflate) -> None:
        self.used -= holder.held
        holder.held = 0
        self._holders.pop(id(holder), None)

    def _sweep(self) -> None:
        for holder in list(self._holders.values()):
            if holder.gone():
                self.release(holder)


class InflatePace:
    """The server's inflation rate, at most `bytes_per_second` (a token bucket holding
    `INFLATE_BURST` seconds of it): `spent` records bytes inflated, `wait` (awaited by a
    connection's reader before each read) returns once the server is back within its pace,
    connections in turn."""

    def __init__(self, bytes_per_second: float) -> None:
        self.bytes_per_second = bytes_per_second
        self._free_at = -math.inf  # when the inflated bytes so far are paid for
        self._turn = trio.Lock()  # FIFO: waiting connections go in the order they came
        self.waited = 0.0  # seconds readers spent waiting (for tests and the bench)

    def spent(self, size: int) -> None:
        if self.bytes_per_second == math.inf:
            return
        now = trio.current_time()
        self._free_at = max(self._free_at, now - INFLATE_BURST) + size / self.bytes_per_second

    async def wait(self) -> None:
        if self._free_at <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        async with self._turn:
            delay = self._free_at - trio.current_time()
            if delay > 0:
                self.waited += delay
                await trio.sleep(delay)


@attrs.frozen
class InflateLimits:
    """What `HypercornConfig.websocket_inflate` holds: a message's inflated bytes at most,
    the server's budget and its pace (unpaced unless given: the server passes its own)."""

    max_message_bytes: int
    budget: InflateBudget
    pace: InflatePace = attrs.field(factory=lambda: InflatePace(math.inf))


class BoundedPerMessageDeflate(PerMessageDeflate):
    """wsproto's permessage-deflate, inflating in steps within a message limit and the
    server's budget (see the module docstring)."""

    def __init__(self, limits: InflateLimits, stream: Any = None, socket: Any = None) -> None:
        super().__init__()
        self._limits = limits
        self.socket = socket  # the connection's trio socket (a closed one frees its bytes)
        # hypercorn's `WSStream` (weakly: it holds this extension through its connection),
        # whose buffer holds the message being inflated.
        self._stream = weakref.ref(stream) if stream is not None else None
        self.held = 0  # bytes of the budget this connection holds
        self.inflated = 0  # bytes of the current message so far
        self.last_output = 0  # bytes of the last call's output (see `_inflate`)

    async def pace(self) -> None:
        """Wait until the server is back within its inflation pace (before a read)."""
        await self._limits.pace.wait()

    def gone(self) -> bool:
        """Whether the connection's socket is closed."""
        sock = self.socket
        return sock is not None and sock.fileno() == -1

    def _fail(self, reason: CloseReason) -> CloseReason:
        """Fail the connection (`reason`: its close code): the partial message hypercorn
        buffered is dropped now (it will never be delivered), and its bytes leave the budget."""
        stream = self._stream() if self._stream is not None else None
        # hypercorn's private internals, typed by neither it nor us
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.clear()
        self._limits.budget.fail(self)
        self.inflated = self.last_output = 0
        self._decompressor = None
        return reason

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        """Inflate `data` in steps; each step's bytes are reserved twice: once for the
        message (hypercorn's buffer holds them until it is complete) and once for this call's
        output, which wsproto's and hypercorn's event generators keep referenced (the last
        frame, the last event) until the next frame has been parsed: the previous call's
        output is released when this one returns, not before."""
        assert self._decompressor is not None
        budget = self._limits.budget
        previous = self.last_output
        produced = 0
        pieces: list[bytes] = []
        limit = self._limits.max_message_bytes
        pending = data
        try:
            while True:
                room = limit - self.inflated
                piece = self._decompressor.decompress(pending, min(INFLATE_STEP, room + 1))
                pending = self._decompressor.unconsumed_tail
                if piece:
                    if len(piece) > room:
                        return self._fail(CloseReason.MESSAGE_TOO_BIG)
                    if not budget.take(self, 2 * len(piece)):
                        return self._fail(CloseReason.TRY_AGAIN_LATER)
                    self.inflated += len(piece)
                    self._limits.pace.spent(len(piece))
                    produced += len(piece)
                    pieces.append(piece)
                if not pending:
                    budget.give_back(self, previous)
                    self.last_output = produced
                    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        except zlib.error:
            return self._fail(CloseReason.INVALID_FRAME_PAYLOAD_DATA)

    def frame_inbound_payload_data(
        self, proto: FrameDecoder | FrameProtocol, data: bytes
    ) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        return self._inflate(bytes(data))

    def frame_inbound_complete(
        self, proto: FrameDecoder | FrameProtocol, fin: bool
    ) -> bytes | CloseReason | None:
        if not fin:
            return None
        if not self._inbound_is_compressible or not self._inbound_compressed:
            self._inbound_compressed = None
            return None
        tail = self._inflate(b"\x00\x00\xff\xff")
        if isinstance(tail, CloseReason):
            return tail
        if proto.client:
            no_context_takeover = self.server_no_context_takeover
        else:
            no_context_takeover = self.client_no_context_takeover
        if no_context_takeover:
            self._decompressor = None
        self._inbound_compressed = None
        # The message is complete: hypercorn hands it to the app, whose queue is bounded.
        self._limits.budget.release(self)
        self.inflated = self.last_output = 0
        return tail


def _deflate_for_handshake() -> PerMessageDeflate:
    """What hypercorn's `Handshake.accept` instantiates: the bounded extension when the
    accepting stream's server has inflate limits, else wsproto's."""
    accepting = _accepting.get(None)
    # our setting on hypercorn's Config (a plain Config lacks it)
    limits = getattr(getattr(accepting, "config", None), "websocket_inflate", None)
    if not isinstance(limits, InflateLimits):
        return PerMessageDeflate()
    from ._transport import HypercornTransport

    extension = BoundedPerMessageDeflate(
        limits, stream=accepting, socket=HypercornTransport(accepting)._socket()
    )
    # The TCP server reads this connection in small pieces once deflate is negotiated
    # (`_http_limits.INFLATE_READ`).
    protocol = getattr(getattr(accepting, "send", None), "__self__", None)
    # hypercorn's private internals, typed by neither it nor us
    server = getattr(getattr(protocol, "send", None), "__self__", None)
    if server is not None:
        server.rollout_inflater = extension
    return extension


def bound_inflation() -> None:
    """Install `BoundedPerMessageDeflate` for servers whose hypercorn config has
    `websocket_inflate` (see the module docstring). Idempotent."""
    from hypercorn.protocol import ws_stream

    original = ws_stream.WSStream._accept
    # our mark on the function we patched
    if getattr(original, "_rollout_inflate", False):
        return

    @functools.wraps(original)
    async def _accept(self: Any, message: Any) -> None:
        token = _accepting.set(self)
        try:
            await original(self, message)
        finally:
            _accepting.reset(token)

    _accept._rollout_inflate = True  # type: ignore[attr-defined]
    ws_stream.WSStream._accept = _accept  # type: ignore[method-assign]
    setattr(ws_stream, "PerMessageDeflate", _deflate_for_handshake)  # noqa: B010
