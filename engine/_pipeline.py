"""The request pipeline: validate, render, classify, route, as explicit pluggable stages.

`Pipeline.prepare` takes a request and the parent state (None for a new chain) and does the
pre-inference work for the *new* input only: the parent's items are already validated,
rendered and classified, and its route is reused when the model string is unchanged. Work is
staged and committed to the lineage only when every stage has passed, so a failed request
leaves its parent untouched (and still the tip of its chain).
"""

from __future__ import annotations

import base64
import binascii
import re
import typing
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
from rollout.protocol import (
    InputFile,
    InputImage,
    Item,
    ItemReference,
    Message,
    RemoteProtocolError,
    ResponseCreate,
    Tool,
    call_of,
    output_of,
)

from ._counters import Counters, StageTimer
from ._ids import new_id
from ._interfaces import Classifier, Flag, ParamCheckingBackend, Renderer
from ._models import ModelRegistry
from ._state import CallRecord, Lineage, Prefix, ResponseState, Route, digest_tokens
from ._tools import check_text_format, check_tools, offered_tools

__all__ = [
    "ConversationValidator",
    "Pipeline",
    "Prepared",
    "Validator",
    "invalid",
    "normalize_input",
]


def invalid(
    message: str, *, code: str = "invalid_value", param: str | None = None
) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(message, code=code, param=param)


def normalize_input(value: str | list[Item] | None) -> list[Item]:
    if value is None:
        return []
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    return list(value)


class ConversationView(Protocol):
    """What validation may ask about the conversation so far."""

    def call(self, call_id: str) -> CallRecord | None:
        """The tool call with this id, or None if there is none."""
        ...


@attrs.frozen
class _LineageView:
    lineage: Lineage
    n_items: int

    def call(self, call_id: str) -> CallRecord | None:
        return self.lineage.call(call_id, self.n_items)


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
            if getattr(request, param) is not None:
                raise invalid(why, code="unsupported_parameter", param=param)
        if request.background:
            raise invalid(
                "Background responses are not supported by this server.",
                code="unsupported_parameter",
                param="background",
            )
        if request.multi_agent is not None and request.multi_agent.get("enabled"):
            raise invalid(
                "Multi-agent responses are not supported by this server yet.",
                code="unsupported_parameter",
                param="multi_agent",
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
            parts = getattr(item, "content", None)
            if parts is None:
                parts = getattr(item, "output", None)
                field = "output"
            else:
                field = "content"
            if isinstance(parts, list):
                for j, part in enumerate(parts):
                    check_part(part, f"{where}.{field}[{j}]")
            call = call_of(item)
            answer = output_of(item) if call is None else None
            if call is not None:
                call_id, kind, name = call
                if call_id in new_calls or conversation.call(call_id) is not None:
                    raise invalid(f"Duplicate tool call id '{call_id}'.", param=f"{where}.call_id")
                new_calls[call_id] = kind
                if getattr(item, "status", None) != "incomplete":
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


# Id prefixes of the input items that get an id when they come without one.
_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "local_shell_call": "lsh",
    "shell_call": "sh",
    "shell_call_output": "sho",
    "apply_patch_call": "apc",
    "apply_patch_call_output": "apco",
    "computer_call": "cu",
    "computer_call_output": "cuo",
}


def _with_id(item: Item) -> Item:
    prefix = _ID_PREFIX.get(item.type)
    if prefix is None or getattr(item, "id", None) is not None:
        return item
    return typing.cast(Item, attrs.evolve(typing.cast(Any, item), id=new_id(prefix)))


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
        sources = [k for k in ("image_url", "file_id") if getattr(part, k) is not None]
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
        sources = [k for k in ("file_data", "file_id", "file_url") if getattr(part, k) is not None]
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


@attrs.frozen(kw_only=True, eq=False)
class Staged:
    """Items validated, rendered and classified, not yet committed to a lineage."""

    items: list[Item]
    tokens: list[array[int]]
    classifier_state: Any
    open_calls: dict[str, str]
    flags: tuple[Flag, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """The outcome of pre-inference work for one request."""

    state: ResponseState  # the conversation with the new input committed (response: parent's)
    flags: tuple[Flag, ...]
    cached_tokens: int  # context tokens reused from the parent without rendering


class Pipeline:
    def __init__(
        self,
        *,
        validator: Validator,
        renderer: Renderer,
        classifier: Classifier,
        registry: ModelRegistry,
        counters: Counters,
        timer: StageTimer,
        hosted: frozenset[str] = frozenset(),
    ) -> None:
        self.hosted = hosted  # hosted tool types with an executor (offered to the model)
        self.validator = validator
        self.renderer = renderer
        self.classifier = classifier
        self.registry = registry
        self.counters = counters
        self.timer = timer

    # --- stages ---
    def route(self, model: str, parent: ResponseState | None, timings: dict[str, float]) -> Route:
        if parent is not None and parent.route.model == model:
            return parent.route
        with self.timer.measure("route", timings):
            route = self.registry.resolve(model)
            if isinstance(route.backend, ParamCheckingBackend):
                route.backend.check_params(route.params)
            self.counters.route_resolutions += 1
            return route

    def prefix(
        self,
        instructions: str | None,
        tools: Sequence[Tool],
        parent: ResponseState | None,
        timings: dict[str, float],
    ) -> Prefix:
        if parent is not None and parent.prefix.same_as(instructions, tools):
            return parent.prefix
        offered = offered_tools(tools, self.hosted)
        with self.timer.measure("render", timings):
            tokens = self.renderer.render_prefix(instructions, offered)
            self.counters.tokens_rendered += len(tokens)
        with self.timer.measure("classify", timings):
            verdict = self.classifier.feed(
                self.classifier.initial(),
                self.renderer.prefix_text(instructions, offered),
                len(tokens),
            )
            self.counters.chars_classified += verdict.scanned
        return Prefix(
            instructions=instructions,
            tools=tuple(tools),
            offered=offered,
            tokens=tokens,
            digest=digest_tokens(tokens),
            classifier_state=verdict.state,
            flags=verdict.flags,
        )

    def stage(
        self,
        items: Sequence[Item],
        *,
        lineage: Lineage,
        n_items: int,
        classifier_state: Any,
        open_calls: dict[str, str],
        param: str,
        timings: dict[str, float],
        validate: bool = True,
        offset: int = 0,
    ) -> Staged:
        """Validate, render and classify `items` after the first `n_items` of `lineage`."""
        open_calls = dict(open_calls)
        if validate:
            with self.timer.measure("validate", timings):
                self.validator.validate_items(
                    items, _LineageView(lineage, n_items), open_calls, param=param, offset=offset
                )
                self.counters.items_validated += len(items)
                # Input items get ids (for item_reference and input_items); ids never render.
                items = [_with_id(item) for item in items]
        with self.timer.measure("render", timings):
            rendered = [self.renderer.render_item(item) for item in items]
            self.counters.tokens_rendered += sum(len(t) for t in rendered)
        flags: list[Flag] = []
        with self.timer.measure("classify", timings):
            for item, toks in zip(items, rendered, strict=True):
                verdict = self.classifier.feed(
                    classifier_state, self.renderer.item_text(item), len(toks)
                )
                classifier_state = verdict.state
                flags.extend(verdict.flags)
                self.counters.chars_classified += verdict.scanned
        return Staged(
            items=list(items),
            tokens=rendered,
            classifier_state=classifier_state,
            open_calls=open_calls,
            flags=tuple(flags),
        )

    @staticmethod
    def commit(base: ResponseState, staged: Staged, **changes: Any) -> ResponseState:
        """Append staged items to `base`'s conversation (in place on the tip of a chain)."""
        lineage = base.writable_lineage()
        for item, toks in zip(staged.items, staged.tokens, strict=True):
            lineage.append(item, toks)
        return attrs.evolve(
            base,
            lineage=lineage,
            n_items=base.n_items + len(staged.items),
            classifier_state=staged.classifier_state,
            open_calls=tuple(staged.open_calls.items()),
            **changes,
        )

    # --- the whole pre-inference pass ---
    def prepare(
        self,
        request: ResponseCreate,
        parent: ResponseState | None,
        *,
        root: ResponseState,
        new_items: Sequence[Item],
        timings: dict[str, float],
        require_outputs: bool,
        offset: int = 0,
    ) -> Prepared:
        """`root` is `parent`, or for a new chain an empty state to build from. With
        `require_outputs`, every function call must have its output by the end of the input
        (a model can't be sampled while tool results are missing)."""
        with self.timer.measure("validate", timings):
            # Tools resent unchanged on a follow-up were validated with the parent.
            known = parent is not None and parent.prefix.same_as(
                request.instructions, request.tools or ()
            )
            self.validator.validate_request(request, tools_known=known)
        assert request.model is not None
        route = self.route(request.model, parent, timings)
        prefix = self.prefix(request.instructions, request.tools or (), parent, timings)
        staged = self.stage(
            new_items,
            lineage=root.lineage,
            n_items=root.n_items,
            classifier_state=root.classifier_state,
            open_calls=dict(root.open_calls),
            param="input",
            timings=timings,
            offset=offset,
        )
        if require_outputs and staged.open_calls:
            call_id = next(iter(staged.open_calls))
            raise invalid(f"No tool output found for function call {call_id}.", param="input")
        context = len(prefix.tokens) + root.item_tokens + staged.n_tokens
        if context > route.context_window:
            raise invalid(
                f"Your input exceeds the context window of this model: {context} tokens, "
                f"the limit is {route.context_window}.",
                code="context_length_exceeded",
                param="input",
            )
        prefix_reused = parent is not None and prefix is parent.prefix
        reused = root.item_tokens + (len(prefix.tokens) if prefix_reused else 0)
        state = self.commit(root, staged, prefix=prefix, route=route, first_new_item=root.n_items)
        flags = (() if prefix_reused else prefix.flags) + staged.flags
        return Prepared(state=state, flags=flags, cached_tokens=reused)
