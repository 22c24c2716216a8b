"""The one exception our validators and codec hooks raise for a bad field.

It carries the OpenAI error `code`, a message template with a `{param}` placeholder, and the
path of the field below the object being validated. The codec prefixes the path of that object
(`input[3]`, `tools[0]`) to form the final `param`, e.g. `input[3].content[0].type`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_QUOTED_CHARS", "InvalidField", "clip", "describe"]


class InvalidField(ValueError):
    def __init__(self, code: str, template: str, subpath: str = "") -> None:
        super().__init__(template)
        self.code = code
        self.template = template
        self.subpath = subpath

    @classmethod
    def wrong_type(cls, expected: str, got: Any, subpath: str = "") -> InvalidField:
        return cls(
            "invalid_type",
            f"Invalid type for '{{param}}': expected {expected}, but got {describe(got)} instead.",
            subpath,
        )

    @classmethod
    def bad_value(cls, got: Any, supported: list[str], subpath: str = "") -> InvalidField:
        choices = ", ".join(repr(s) for s in supported)
        return cls(
            "invalid_value",
            f"Invalid value: {clip(got)}. Supported values are: {choices}.",
            subpath,
        )

    @classmethod
    def missing(cls, subpath: str = "") -> InvalidField:
        return cls("missing_required_parameter", "Missing required parameter: '{param}'.", subpath)


# Error messages quote peer input; never more than this many characters of it.
MAX_QUOTED_CHARS = 120


def clip(value: Any) -> str:
    """`repr(value)`, cut to MAX_QUOTED_CHARS (peers can send megabytes)."""
    text = repr(value)
    if len(text) > MAX_QUOTED_CHARS:
        text = text[: MAX_QUOTED_CHARS - 3] + "..."
    return text


def describe(value: Any) -> str:
    """How OpenAI names a JSON value's type in error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
