"""The engine's exceptions, one flat hierarchy. Request errors are the protocol's
`RemoteProtocolError` (they carry the OpenAI error to send back); these are the rest."""

from __future__ import annotations

__all__ = ["BackendError", "EngineError"]


class EngineError(Exception):
    """Base class of the engine's own errors."""


class BackendError(EngineError):
    """A model backend failed. `code` is a `ResponseError` code (`server_error`,
    `rate_limit_exceeded`, ...); `message` is shown to the client in `response.failed`."""

    def __init__(self, message: str, *, code: str = "server_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
