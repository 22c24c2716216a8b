"""Steering (`response.steer`): new user input for a response that is still running, and the
three acknowledgements, after the `openai` SDK's `response_steer_*` types.

The client event carries its `input` exactly as sent (a string, or a non-empty list of user
messages): the codec checks it on decode (`decode_client_event`) and a steer that fails the
check decodes to `InvalidSteer`, which the connection answers with `response.steer.failed`
(`invalid_input`) echoing that input. `steer_items` turns a checked input into items.

Sequence numbers (spec/PROTOCOL.md, ST-2): an acknowledgement about a response of the
connection's slot is an event of that response's stream and takes its next sequence number
(also after its terminal event: `response.steer.pending`, and `response.steer.failed` for
accepted input that could not be committed); an answer that no response's stream holds (the
target is unknown or has ended, or the steer is malformed) carries `sequence_number` 0, which
no in-stream acknowledgement can have (`response.created` is 0).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs

from ._lanes import stream_id_field

__all__ = [
    "OUT_OF_STREAM",
    "STEER_EVENT_TYPES",
    "InvalidSteer",
    "RequiredInput",
    "ResponseSteer",
    "ResponseSteerAccepted",
    "ResponseSteerFailed",
    "ResponseSteerPending",
    "SteerAck",
    "SteerError",
    "SteerRef",
    "SteerSubmission",
    "steer_failed",
]

# The sequence number of a steering answer outside any response's stream.
OUT_OF_STREAM = 0


@attrs.frozen(kw_only=True)
class ResponseSteer:
    """`response.steer`: queue `input` for the running response `previous_response_id`.
    `input` is the JSON value as sent (checked by the codec when decoded)."""

    type: Literal["response.steer"] = "response.steer"
    previous_response_id: str
    input: Any


@attrs.frozen(kw_only=True)
class InvalidSteer:
    """Not a wire type: a `response.steer` message that failed the checks, with what it carried
    (to echo) and why (`message`). `previous_response_id` is "" when it carried no string."""

    previous_response_id: str
    input: Any
    message: str


@attrs.frozen(kw_only=True)
class SteerRef:
    id: str
    previous_response_id: str


@attrs.frozen(kw_only=True)
class SteerSubmission:
    """The submission a failure returns: its original input, and its id once allocated."""

    input: Any
    previous_response_id: str
    id: str | None = None


@attrs.frozen(kw_only=True)
class SteerError:
    type: str = "invalid_request_error"
    code: str
    message: str


@attrs.frozen(kw_only=True)
class RequiredInput:
    """A stub naming input a response waits for (`response.steer.pending`): the output type
    and `call_id` (with `name` for a function call, `execution` for a client tool search), or
    `approval_request_id` for an MCP approval."""

    type: str
    call_id: str | None = None
    name: str | None = None
    execution: str | None = None
    approval_request_id: str | None = None


@attrs.frozen(kw_only=True)
class ResponseSteerAccepted:
    type: Literal["response.steer.accepted"] = "response.steer.accepted"
    sequence_number: int
    steer: SteerRef
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseSteerPending:
    type: Literal["response.steer.pending"] = "response.steer.pending"
    sequence_number: int
    reason: str = "waiting_for_required_input"
    required_input: list[RequiredInput]
    steer: SteerRef
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseSteerFailed:
    type: Literal["response.steer.failed"] = "response.steer.failed"
    sequence_number: int
    error: SteerError
    steer: SteerSubmission
    stream_id: str | None = stream_id_field()


SteerAck: TypeAlias = ResponseSteerAccepted | ResponseSteerPending | ResponseSteerFailed
STEER_EVENT_TYPES = frozenset(
    {"response.steer.accepted", "response.steer.pending", "response.steer.failed"}
)


def steer_failed(
    steer: ResponseSteer | InvalidSteer,
    code: str,
    message: str,
    *,
    steer_id: str | None = None,
    sequence_number: int = OUT_OF_STREAM,
    stream_id: str | None = None,
) -> ResponseSteerFailed:
    """`response.steer.failed` returning `steer`'s original input (out of any stream unless
    a `sequence_number` is given): a malformed steer's as sent, a valid one's with each
    message's `type` ("message", optional on input, which the SDK's type requires)."""
    given = steer.input
    if isinstance(steer, ResponseSteer) and isinstance(given, list):
        given = [_typed(message) for message in given]
    return ResponseSteerFailed(
        sequence_number=sequence_number,
        error=SteerError(code=code, message=message),
        steer=SteerSubmission(
            input=given, previous_response_id=steer.previous_response_id, id=steer_id
        ),
        stream_id=stream_id,
    )


def _typed(message: Any) -> Any:
    if isinstance(message, dict) and "type" not in message:
        return {"type": "message", **message}
    return message
