"""The engine's exceptions, one flat hierarchy. Request errors are the protocol's
`RemoteProtocolError` (they carry the OpenAI error to send back); these are the rest."""

from __future__ import annotations

from rollout.protocol import ErrorBody, RemoteProtocolError

__all__ = [
    "BackendError",
    "EngineError",
    "previous_response_not_found",
    "server_error",
    "shutting_down",
]


class EngineError(Exception):
    """Base class of the engine's own errors."""


class BackendError(EngineError):
    """A model backend failed. `code` is a `ResponseError` code (`server_error`,
    `rate_limit_exceeded`, ...); `message` is shown to the client in `response.failed`."""

    def __init__(self, message: str, *, code: str = "server_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def server_error() -> RemoteProtocolError:
    """The request error for an unexpected failure before a response started (HTTP 500)."""
    return RemoteProtocolError(
        ErrorBody(
            type="server_error",
            code="server_error",
            message="The server had an error while processing your request. Sorry about that!",
        ),
        status=500,
    )


def shutting_down() -> RemoteProtocolError:
    """The request error for a create that arrives after the grace period of a shutdown."""
    return RemoteProtocolError(
        ErrorBody(
            type="server_error",
            code="server_error",
            message="The server is shutting down; retry the request on another connection.",
        ),
        status=503,
    )


def previous_response_not_found(response_id: str) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(
        f"Previous response with id '{response_id}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )
