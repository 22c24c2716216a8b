"""WebSocket lanes (`stream_id`): what a lane id may be, and the limits of a connection's lanes.

A `response.create` naming a `stream_id` runs on that lane; one without runs on the default
lane. Lanes are FIFO and run concurrently (`_connection.py` applies the rules, PROTOCOL.md
WS-7 states them). The numbers are OpenAI's, from its WebSocket-mode guide.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from ._response import OMIT_IF_NONE

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_LANES",
    "MAX_STREAM_ID_CHARS",
    "stream_id_field",
    "valid_stream_id",
]

# Named lanes a connection may open over its life (the default lane is not one of them):
# OpenAI's limit. A lane, once opened, stays open (and counted) until the connection closes, so
# a connection holds at most this many lanes' state.
DEFAULT_MAX_LANES = 32
# Responses a connection runs at once across its lanes (OpenAI's limit); more creates are not
# refused, they wait for a response to end. A suspended rollout is in flight: it holds its
# state and its lane until it ends.
DEFAULT_MAX_IN_FLIGHT = 16
# The longest lane id: 1 to 256 characters of `[A-Za-z0-9_.-]` (an empty one is invalid: omit
# `stream_id` for the default lane).
MAX_STREAM_ID_CHARS = 256

_STREAM_ID = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_STREAM_ID_CHARS}}}")


def valid_stream_id(value: object) -> bool:
    """Whether `value` names a lane: a string of 1 to 256 characters of `[A-Za-z0-9_.-]`."""
    return isinstance(value, str) and _STREAM_ID.fullmatch(value) is not None


def stream_id_field() -> Any:
    """The `stream_id` of a WebSocket server event: its lane, encoded only when set (server
    events encode their other absent fields as explicit nulls)."""
    return attrs.field(default=None, metadata={OMIT_IF_NONE: True})
