"""The benchmark's exceptions: one base class, a flat hierarchy."""

from __future__ import annotations

__all__ = [
    "BenchError",
    "PreflightError",
    "ServerError",
    "ServerStartError",
    "ServerUnreachable",
    "StreamError",
]


class BenchError(Exception):
    """Base class of the benchmark's errors."""


class ServerError(BenchError):
    """The server under test answered with an error, failed a response, or broke the protocol
    (the message names the mode, the turn and what the server sent)."""


class ServerStartError(BenchError):
    """The `rollout serve` subprocess did not come up."""


class StreamError(ServerError):
    """What arrived is not what the server produced: a turn's deltas do not add up to its
    items' text, or their tokens to its usage."""


class ServerUnreachable(BenchError):
    """Nothing answers at a server's URL: the benchmark stops before running anything."""


class PreflightError(BenchError):
    """A server refused the benchmark's first request (its key, its model, the tool call the
    loop needs): the benchmark stops before running anything, naming the fix."""
