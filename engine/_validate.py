"""Validation, the pipeline's first stage: a request and its new items against the
conversation so far, before anything is rendered.

`ConversationValidator` is the built-in `Validator`: tools, tool choices and refused features
at the request level; at the item level, every tool output answers an open call of its kind,
call ids are new, content parts are bounded (inline images and files) and well-formed.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from rollout.protocol import (
    FunctionTool,
    InputFile,
    InputImage,
    Item,
    ItemReference,
    NamespaceTool,
    RemoteProtocolError,
    ResponseCreate,
    call_of,
    check_multi_agent,
    output_of,
    parts_of,
    status_of,
)

from ._schemas import MAX_REQUEST_SCHEMA_NODES, count_nodes
from ._state import CallRecord
from ._tools import check_text_format, check_tools

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_IMAGE_BYTES",
    "ConversationValidator",
    "ConversationView",
    "Validator",
    "check_part",
    "invalid",
    "schema_nodes",
]


def invalid(
    message: str, *, code: str = "invalid_value", param: str | None = None
) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(message, code=code, param=param)


def _schemas(request: ResponseCreate, *, tools_known: bool) -> Iterator[Any]:
    """The JSON schemas validation checks: function tools' parameters (unless `tools_known`)
    and a `text.format` schema."""
    if not tools_known:
        for tool in request.tools or ():
            for member in tool.tools if isinstance(tool, NamespaceTool) else (tool,):
                if isinstance(member, FunctionTool) and member.parameters is not None:
                    yield member.parameters
    if request.text is not None and request.text.format.get("type") == "json_schema":
        yield request.text.format.get("schema")


def schema_nodes(request: ResponseCreate, *, tools_known: bool, cap: int) -> int:
    """The JSON values of the schemas validation checks, counted up to `cap` (cheap: at most
    `cap` values are visited)."""
    total = 0
    for schema in _schemas(request, tools_known=tools_known):
        total += count_nodes(schema, cap - total)
        if total >= cap:
            break
    return total


class ConversationView(Protocol):
    """What validation may ask about the conversation so far."""

    def call(self, call_id: str) -> CallRecord | None:
        """The tool call with this id, or None if there is none."""
        ...


class Validator(Protocol):
    """Structure and semantics of a request against its conversation."""

    def validate_request(self, request: ResponseCreate, *, tools_known: bool = False) -> None:
        """`tools_known`: the tools are those of the parent, already validated."""
        ...

    def validate_items(
        self,
        items: Sequence[Item],
        conversation: ConversationView,
        open_calls: dict[str, str],
        *,
        param: str,
        offset: int = 0,
    ) -> None:
        """Check new items; update `open_calls` (call_id -> name) as calls and outputs pass."""
        ...


class ConversationValidator:
    """The built-in validator.

    Request level: a model is named; tools have unique names, valid JSON schemas and bounded
    grammars; a named `tool_choice` names a declared tool; features rollout cannot honour
    (and whose silent omission would mislead) are refused by name.
    Item level: every tool output answers a call of the same kind (function, custom, shell,
    ...) in the conversation that has no output yet; a call's `call_id` is new; item
    references are resolved before validation (by the caller) and refused if any remain.
    `hosted` names the hosted tool types an executor is configured for.
    """

    def __init__(self, *, hosted: frozenset[str] = frozenset()) -> None:
        self.hosted = hosted

    def validate_request(self, request: ResponseCreate, *, tools_known: bool = False) -> None:
        if not request.model:
            raise invalid(
                "Missing required parameter: 'model'.",
                code="missing_required_parameter",
                param="model",
            )
        for param, why in (
            (
                "conversation",
                "Conversations are not supported by this server; use previous_response_id.",
            ),
            (
                "prompt",
                "Prompt templates are not supported by this server; send the "
                "instructions and input themselves.",
            ),
        ):
            if getattr(request, param) is not None:  # the fields named in this table
                raise invalid(why, code="unsupported_parameter", param=param)
        if request.background:
            raise invalid(
                "Background responses are not supported by this server.",
                code="unsupported_parameter",
                param="background",
            )
        check_multi_agent(request.multi_agent)
        budget = MAX_REQUEST_SCHEMA_NODES
        if schema_nodes(request, tools_known=tools_known, cap=budget + 1) > budget:
            raise invalid(
                f"The request's JSON schemas (tools' parameters and text.format.schema) have "
                f"more than {budget} values in all.",
                param="tools" if request.tools else "text.format.schema",
            )
        check_tools(
            request.tools or (),
            request.tool_choice,
            hosted=self.hosted,
            schemas_known=tools_known,
        )
        if request.text is not None:
            check_text_format(request.text.format)

    def validate_items(
        self,
        items: Sequence[Item],
        conversation: ConversationView,
        open_calls: dict[str, str],
        *,
        param: str,
        offset: int = 0,
    ) -> None:
        new_calls: dict[str, str] = {}  # call_id -> kind, calls made by these items
        for k, item in enumerate(items):
            where = f"{param}[{offset + k}]"
            found = parts_of(item)
            if found is not None:
                field, parts = found
                for j, part in enumerate(parts):
                    check_part(part, f"{where}.{field}[{j}]")
            call = call_of(item)
            answer = output_of(item) if call is None else None
            if call is not None:
                call_id, kind, name = call
                if call_id in new_calls or conversation.call(call_id) is not None:
                    raise invalid(f"Duplicate tool call id '{call_id}'.", param=f"{where}.call_id")
                new_calls[call_id] = kind
                if status_of(item) != "incomplete":
                    # A call cut off by max_output_tokens was never made and waits for no
                    # output: the same rule as for the model's own output (Session._extend),
                    # so stateless input and hydration agree with the cached state.
                    open_calls[call_id] = name
            elif answer is not None:
                _check_answer(answer, where, new_calls, conversation, open_calls)
            elif isinstance(item, ItemReference):
                raise invalid(
                    f"Item reference '{item.id}' could not be resolved.",
                    code="item_not_found",
                    param=f"{where}.id",
                )


def _check_answer(
    answer: tuple[str | None, str],
    where: str,
    new_calls: dict[str, str],
    conversation: ConversationView,
    open_calls: dict[str, str],
) -> None:
    """A tool output answers an open call of its own kind; it then closes that call."""
    call_id, kind = answer
    id_param = f"{where}.id" if kind == "local_shell" else f"{where}.call_id"
    if call_id is None:
        raise invalid(
            "Missing required parameter: 'call_id' (the call this output answers).",
            code="missing_required_parameter",
            param=id_param,
        )
    record = conversation.call(call_id)
    called = new_calls.get(call_id) or (record.kind if record is not None else None)
    if call_id not in open_calls:
        why = "already has an output" if called is not None else "was not found"
        raise invalid(
            f"No tool call found for {kind} call output with call_id '{call_id}': the call {why}.",
            param=id_param,
        )
    if called != kind:
        raise invalid(
            f"The {kind} call output with call_id '{call_id}' answers a {called} call.",
            param=f"{where}.type",
        )
    del open_calls[call_id]


# Limits on inline content (decoded bytes). OpenAI accepts images up to 20 MB and files up to
# 32 MB per part; the whole message is also bounded by the server's maximum message size.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_FILE_BYTES = 32 * 1024 * 1024
IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
URL_SCHEMES = ("https://", "http://")
_DATA_URL = re.compile(r"^data:([a-z0-9.+-]+/[a-z0-9.+-]+)(;[^,;]*)*;base64,", re.IGNORECASE)


def _data_url(
    value: str, where: str, *, what: str, limit: int, mimes: frozenset[str] | None
) -> None:
    match = _DATA_URL.match(value)
    if match is None:
        raise invalid(
            f"Invalid {what} data URL: expected 'data:<mime type>;base64,<data>'.",
            code=f"invalid_{what}_url" if what == "image" else "invalid_file_data",
            param=where,
        )
    mime = match.group(1).lower()
    if mimes is not None and mime not in mimes:
        allowed = ", ".join(sorted(mimes))
        raise invalid(
            f"Invalid image format '{mime}'. Supported formats are: {allowed}.",
            code="invalid_image_format",
            param=where,
        )
    payload = value[match.end() :]
    size = len(payload) * 3 // 4
    if size > limit:
        raise invalid(
            f"The {what} is about {size} bytes, larger than the limit of {limit} bytes.",
            code=f"{what}_too_large",
            param=where,
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error):
        data = None
    # An empty file is a file; an empty image is not an image.
    if data is None or (what == "image" and not data):
        raise invalid(
            f"The {what} data is not valid base64" + ("." if data is None else ": it is empty."),
            code="invalid_base64_image" if what == "image" else "invalid_file_data",
            param=where,
        ) from None


def check_part(part: Any, where: str) -> None:
    """Images and files in content: one source each, known URL schemes, bounded inline data."""
    if isinstance(part, InputImage):
        given = {"image_url": part.image_url, "file_id": part.file_id}
        sources = [k for k, v in given.items() if v is not None]
        if len(sources) != 1:
            raise invalid(
                "An input_image needs exactly one of image_url or file_id.",
                code="invalid_value" if sources else "missing_required_parameter",
                param=f"{where}.image_url",
            )
        url = part.image_url
        if url is not None:
            if url.startswith("data:"):
                _data_url(
                    url,
                    f"{where}.image_url",
                    what="image",
                    limit=MAX_IMAGE_BYTES,
                    mimes=IMAGE_MIME_TYPES,
                )
            elif not url.startswith(URL_SCHEMES):
                raise invalid(
                    "Unsupported image URL: use an https URL or a base64 data URL.",
                    code="invalid_image_url",
                    param=f"{where}.image_url",
                )
    elif isinstance(part, InputFile):
        given = {"file_data": part.file_data, "file_id": part.file_id, "file_url": part.file_url}
        sources = [k for k, v in given.items() if v is not None]
        if len(sources) != 1:
            raise invalid(
                "An input_file needs exactly one of file_data, file_id or file_url.",
                code="invalid_value" if sources else "missing_required_parameter",
                param=f"{where}.file_data",
            )
        if part.file_data is not None:
            _data_url(
                part.file_data, f"{where}.file_data", what="file", limit=MAX_FILE_BYTES, mimes=None
            )
        if part.file_url is not None and not part.file_url.startswith(URL_SCHEMES):
            raise invalid(
                "Unsupported file URL: use an https URL, or file_data with a data URL.",
                code="invalid_file_url",
                param=f"{where}.file_url",
            )
