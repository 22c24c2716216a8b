"""Logging for `rollout serve`: every record of the process, one line each, on stderr.

Two formats. `text` is for a person at a terminal: `time LEVEL logger: message`. `json` is for
a log pipeline: every line is one JSON object (`timestamp` in ISO 8601 UTC, `level`, `logger`,
`message`, and the record's own fields, e.g. an access line's `event`, `method`, `path`,
`status`, `seconds`), tracebacks included (`exc_info`, a string), so `jq` reads the whole stream.

Access lines are logged on `rollout.access` with their fields as `extra`, so both formats come
from one call. hypercorn's own log goes to `rollout.http` at warning and above: its one info
line ("Running on ...") repeats ours without the `/v1` base URL clients need.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

__all__ = ["HTTP_LOGGER", "LogFormat", "configure_logging"]

LogFormat = Literal["text", "json"]

# The logger hypercorn writes to (its `errorlog`): protocol errors, failures in its workers.
HTTP_LOGGER = "rollout.http"

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attributes every record has; the rest came as `extra`.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class TextFormatter(logging.Formatter):
    """`_TEXT`; a library's record whose message is only a name (stamina's
    "stamina.retry_scheduled") gets its `extra` fields after it as key=value. rollout's own
    records say everything in their message (their fields are for the JSON format)."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        if record.name.startswith("rollout"):
            return line
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        return f"{line} {fields}" if fields else line


def formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp=True,
        )
    return TextFormatter()


def configure_logging(level: str, fmt: LogFormat = "text") -> None:
    """Send every record at `level` or above to stderr in `fmt`, replacing earlier handlers;
    Python warnings become records too (so a JSON stream stays JSON)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    root.setLevel(numeric)
    logging.getLogger(HTTP_LOGGER).setLevel(max(numeric, logging.WARNING))
    logging.captureWarnings(True)
