"""The protocol's two errors, after h11: the local one (we broke the protocol) and the
remote one (the peer did). A remote error carries the ready-made OpenAI-shaped error that
goes back on the wire, so the I/O layer never has to invent error text."""

from __future__ import annotations

from typing import Literal

import attrs

from ._lanes import stream_id_field

__all__ = [
    "ErrorBody",
    "ErrorEvent",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
]


@attrs.frozen(kw_only=True)
class ErrorBody:
    """The body every OpenAI error shares: HTTP `{"error": {...}}`, the nested WebSocket
    `error` event, and (flattened) the SSE `error` event."""

    type: str = "invalid_request_error"
    code: str | None = None
    message: str
    param: str | None = None


@attrs.frozen(kw_only=True)
class ErrorEvent:
    """The WebSocket `error` event, nested: `{"type": "error", "status", "error": {...}}`;
    `stream_id` names the lane of the request it answers (absent on the default lane).
    (Here rather than in `_events`, which re-exports it: a remote error builds it.)"""

    type: Literal["error"] = "error"
    status: int | None = None
    sequence_number: int | None = None
    error: ErrorBody
    stream_id: str | None = stream_id_field()


class ProtocolError(Exception):
    """Base class of every error the protocol layer raises."""


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (a bug on our side, never the peer's)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids.

    `body` and `status` are exactly what should be sent back: over WebSocket as the nested
    `error` event (see `error_event()`), over HTTP as `{"error": body}` with `status`.
    `stream_id`: the lane of the WebSocket request it answers, when known (echoed).
    """

    def __init__(self, body: ErrorBody, status: int = 400, *, stream_id: str | None = None) -> None:
        super().__init__(body.message)
        self.body = body
        self.status = status
        self.stream_id = stream_id

    @classmethod
    def invalid(
        cls, message: str, *, code: str | None, param: str | None = None, status: int = 400
    ) -> RemoteProtocolError:
        return cls(ErrorBody(code=code, message=message, param=param), status)

    @property
    def code(self) -> str | None:
        return self.body.code

    @property
    def param(self) -> str | None:
        return self.body.param

    def error_event(self) -> ErrorEvent:
        return ErrorEvent(status=self.status, error=self.body, stream_id=self.stream_id)

    def __repr__(self) -> str:
        return f"RemoteProtocolError(status={self.status}, body={self.body!r})"
