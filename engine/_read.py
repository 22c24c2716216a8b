"""Socket reads into warm memory: what the server's TCP reader takes from a connection.

hypercorn's trio reader takes up to 64 KiB a read (`SocketStream.receive_some`), and every
read goes through the HTTP or WebSocket parser and on to the app before the next: a client
resending its whole conversation (0.55 MB at ~100k tokens) costs eight or nine such trips.
Asking `receive_some` for more is no cure: CPython allocates a bytes object of the size asked
for before the system call, and glibc serves 1 MiB with a fresh `mmap`, so the kernel's copy
of 0.5 MB faults in ~130 new pages on the way, ~250 us on this project's 2-core VM against
~45 us for the same bytes in 64 KiB reads (and a 1.4 KB WebSocket frame costs ~13 us
instead of ~1.5 us: an `mmap`, an `mremap` and a `munmap` per read).

`read_some` reads up to `READ_SIZE` (1 MiB) into one buffer kept per thread, whose pages stay
mapped, and returns a copy of what came: one copy of the bytes read, from warm memory (~40 us
for 0.5 MB, ~2 us for a small frame). `read_cut` returns the same read in two pieces, each
copied out once, where a caller's cut says: `_http_limits` cuts a request's head from the body
behind it, so the body goes on as the bytes read (h11 holds them as they are:
`_h11_body.py`). A large body that has arrived is then one read, one pass through the parser
and one ASGI message. A client pushing a large body is often still sending when its first
bytes wake the reader (at ~100k tokens here the first read took 260-330 KB of 0.55 MB, and the
rest came in a second read after the head's handling); a read that took `READ_ON` (64 KiB) or
more therefore reads on, without waiting, what came while it copied, until nothing more is
there. An error met then (a reset) is kept for the socket's next read.

The buffer is shared by every connection of a thread safely because the copy is taken before
the task can be suspended: the read is a non-blocking system call after trio said the socket
was readable, and the read's checkpoint (as `receive_some`'s, after a successful read) comes
after the copy.

What a read hands on is bounded as before: the parser's and the app's limits
(`_http_limits.py`, the WebSocket limits) apply to what arrives, and hypercorn's queue to the
app holds at most `max_app_queue_size` messages of it. Errors are `receive_some`'s: a socket
closed under the read is `trio.ClosedResourceError`, any other failure
`trio.BrokenResourceError`. A stream that is not a plain `trio.SocketStream` (TLS) reads
through its own `receive_some`.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections.abc import Callable

import trio

__all__ = ["READ_SIZE", "Cut", "read_cut", "read_some"]

# The most one read takes. A 0.55 MB body (~100k tokens of history) that has arrived fits one
# read; larger bodies take a few. The buffer costs this much once per thread that reads.
READ_SIZE = 1 << 20

# `receive_some`'s size for streams read through it (hypercorn's `MAX_RECV`).
STREAM_READ_SIZE = 1 << 16

# A read of at least this much is taken to be part of a larger transfer still arriving (the
# loopback and network cards hand the kernel up to 64 KiB at a time): the read goes on, without
# waiting, with what came while it copied, so a body a client is still pushing is one read more
# often. Smaller reads (a WebSocket event, a small request) stay one system call.
READ_ON = 1 << 16

_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})  # as trio's SocketStream

# An error met reading on after bytes had come, kept for the socket's next read (which would
# not meet it again: Linux reports a reset once). At most one per socket, dropped with it.
_pending: weakref.WeakKeyDictionary[trio.socket.SocketType, OSError] = weakref.WeakKeyDictionary()


class _Buffer(threading.local):
    def __init__(self) -> None:
        self.array = bytearray(READ_SIZE)
        self.view = memoryview(self.array)


_buffer = _Buffer()

# Where to cut what was read: given the buffer and the number of bytes read into it, an offset
# from 0 to that number.
Cut = Callable[[bytes | bytearray, int], int]


async def read_some(stream: trio.abc.ReceiveStream, max_bytes: int = READ_SIZE) -> bytes:
    """The bytes that have arrived on `stream`, up to `max_bytes` (at most `READ_SIZE`;
    waiting for some first); `b""` at the end of the stream."""
    return (await _read(stream, max_bytes, None))[0]


async def read_cut(stream: trio.abc.ReceiveStream, cut: Cut) -> tuple[bytes, bytes]:
    """As `read_some` (up to `READ_SIZE`), in two pieces, before and after `cut`'s offset
    into what was read; each piece is copied out of the buffer once (a slice of a whole read
    would copy its second piece again). `(b"", b"")` at the end of the stream."""
    first, rest = await _read(stream, READ_SIZE, cut)
    return first, rest


async def _read(
    stream: trio.abc.ReceiveStream, max_bytes: int, cut: Cut | None
) -> tuple[bytes, ...]:
    max_bytes = min(max_bytes, READ_SIZE)
    if not isinstance(stream, trio.SocketStream):
        data = bytes(await stream.receive_some(min(max_bytes, STREAM_READ_SIZE)))
        if cut is None:
            return (data,)
        at = cut(data, len(data))
        return data[:at], data[at:]
    sock = stream.socket
    view = _buffer.view if max_bytes == READ_SIZE else _buffer.view[:max_bytes]
    await trio.lowlevel.checkpoint_if_cancelled()
    waited = False
    while True:
        try:
            error = _pending.pop(sock, None)
            if error is not None:
                raise error
            n = os.readv(sock.fileno(), [view])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            waited = True
            continue
        except OSError as exc:
            if exc.errno in _CLOSED_ERRNOS:
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        if n >= READ_ON:
            n = _read_on(sock, view, n)
        # copied out before any checkpoint: the buffer is the thread's
        if cut is None:
            pieces: tuple[bytes, ...] = (bytes(view[:n]),)
        else:
            at = min(cut(_buffer.array, n), n)
            pieces = bytes(view[:at]), bytes(view[at:n])
        break
    if not waited:  # as trio's own reads: a read that did not wait still checkpoints
        await trio.lowlevel.cancel_shielded_checkpoint()
    return pieces


def _read_on(sock: trio.socket.SocketType, view: memoryview, n: int) -> int:
    """`n` bytes read into `view`, and what else has arrived since, read without waiting
    until nothing more is there, the end of the stream, or `view` is full. An error is kept
    for the socket's next read, which raises it as `read_some` would have."""
    while n < len(view):
        try:
            got = os.readv(sock.fileno(), [view[n:]])
        except BlockingIOError:
            break
        except OSError as exc:
            _pending[sock] = exc
            break
        if not got:
            break
        n += got
    return n
