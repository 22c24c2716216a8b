"""ASGI plumbing shared by the HTTP routes: the request a handler gets, reading a bounded
body, parsing it as JSON, and writing a whole JSON or text response.

Errors travel as exceptions, raised by a handler before it sends anything and answered by the
app (see `RolloutApp._http`): `RemoteProtocolError`, a request the protocol refuses (its status
and OpenAI error body, counted in `request_errors`), or `HttpError`, one the HTTP layer refuses
itself (a body over the limit, a bad page query: not counted).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
from rollout.protocol import RemoteProtocolError

__all__ = [
    "HttpError",
    "HttpRequest",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "error_body",
    "headers_of",
    "method_not_allowed",
    "read_body",
    "read_json",
    "send_json",
    "send_raw",
]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class HttpRequest:
    """One HTTP request as a route handler sees it (the body is still to be received)."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    query: dict[str, str]
    receive: Receive
    send: Send
    owner: str | None  # the API key's owner (None when auth is off)
    params: tuple[str, ...] = ()  # the route pattern's groups


class HttpError(Exception):
    """A request the HTTP layer refuses: `body` goes back with `status`."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


def headers_of(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def error_body(
    message: str,
    *,
    code: str | None,
    param: str | None = None,
    type_: str = "invalid_request_error",
) -> dict[str, Any]:
    """An OpenAI error body for errors the HTTP layer answers itself (routing, auth, limits)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def read_body(
    receive: Receive, limit: int, too_large: str = "The request body is too large."
) -> bytes:
    """The request body; a 413 `HttpError` saying `too_large` once it passes `limit` bytes
    (not read further). A client that disconnects mid-body leaves what arrived."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, error_body(too_large, code="message_too_large"))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


@contextmanager
def _json_errors() -> Iterator[None]:
    """Parse and decode failures of a JSON body as the request errors they are."""
    try:
        yield
    except RecursionError:  # json.loads and the decoders recurse per nesting level
        raise RemoteProtocolError.invalid(
            "The message is nested too deeply.", code="invalid_json"
        ) from None
    except ValueError:
        raise RemoteProtocolError.invalid(
            "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None


async def read_json(receive: Receive, limit: int, decode: Callable[[Any], _T]) -> _T:
    """Read the body (see `read_body`), parse it as JSON and `decode` the value. Failures of
    either (`ValueError`, `RecursionError`) become `invalid_json` request errors; `decode`
    raises `RemoteProtocolError` for anything else it refuses."""
    raw = await read_body(receive, limit)
    with _json_errors():
        return decode(json.loads(raw))


async def send_json(
    send: Send, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> int:
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return await send_raw(send, status, payload, b"application/json", extra)


async def send_raw(
    send: Send,
    status: int,
    payload: bytes,
    content_type: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> int:
    """A whole response with a content length; returns `status` (for the access log)."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": payload})
    return status


async def method_not_allowed(send: Send) -> int:
    return await send_json(send, 405, error_body("Method not allowed.", code="method_not_allowed"))
