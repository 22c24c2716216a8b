"""The `Response` object, with the field set of the official SDK's
`openai.types.responses.Response` and the non-null defaults the Open Responses specification
asks for (temperature 1, top_p 1, tool_choice "auto", truncation "disabled", ...)."""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs

from ._items import Item
from ._tools import Tool, ToolChoice

__all__ = [
    "OMIT_IF_NONE",
    "RESPONSE_ERROR_CODES",
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputTokensDetails",
    "ReasoningConfig",
    "Response",
    "ResponseError",
    "ResponseRef",
    "ResponseStatus",
    "TextConfig",
    "Usage",
]

# attrs field metadata: encode the field only when it is set, in objects whose other absent
# fields are encoded as explicit nulls (rollout's additions to the Response object).
OMIT_IF_NONE = "omit_if_none"

ResponseStatus: TypeAlias = Literal[
    "queued", "in_progress", "completed", "incomplete", "failed", "cancelled"
]
IncompleteReason: TypeAlias = Literal[
    "max_output_tokens", "max_messages", "content_filter", "steered"
]


@attrs.frozen(kw_only=True)
class InputTokensDetails:
    cached_tokens: int = 0
    cache_write_tokens: int = 0


@attrs.frozen(kw_only=True)
class OutputTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen(kw_only=True)
class Usage:
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = attrs.field(factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = attrs.field(factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of(cls, *, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=self.input_tokens_details.cached_tokens
                + other.input_tokens_details.cached_tokens,
                cache_write_tokens=self.input_tokens_details.cache_write_tokens
                + other.input_tokens_details.cache_write_tokens,
            ),
            output_tokens=self.output_tokens + other.output_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=self.output_tokens_details.reasoning_tokens
                + other.output_tokens_details.reasoning_tokens
            ),
            total_tokens=self.total_tokens + other.total_tokens,
        )


# `ResponseError.code` values the SDK's type accepts (a failed response must use one of them).
RESPONSE_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "data_residency_mismatch",
        "bio_policy",
        "misalignment_policy_violation",
        "vector_store_timeout",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)


@attrs.frozen(kw_only=True)
class ResponseError:
    """Why a response failed. `code` is one of the SDK's `ResponseError.code` values
    (`server_error`, `invalid_prompt`, `rate_limit_exceeded`, ...)."""

    code: str
    message: str


@attrs.frozen(kw_only=True)
class IncompleteDetails:
    """Why a response ended early: one of the standard reasons, or a rollout extension:
    `rollout_timeout` when a suspended rollout waited longer than the server's limit,
    `server_shutdown` when the server stopped while the response ran (its output so far and
    its usage are kept)."""

    reason: IncompleteReason | Literal["rollout_timeout", "server_shutdown"] | None = None


Effort: TypeAlias = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
SummaryMode: TypeAlias = Literal["auto", "concise", "detailed"]


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    """`reasoning`, with the SDK's values: `effort` and `summary` are echoed;
    `generate_summary` (the older name of `summary`), `context` and `mode` are accepted and
    echoed only when given."""

    effort: Effort | None = None
    summary: SummaryMode | None = None
    generate_summary: SummaryMode | None = attrs.field(default=None, metadata={OMIT_IF_NONE: True})
    context: Literal["auto", "current_turn", "all_turns"] | None = attrs.field(
        default=None, metadata={OMIT_IF_NONE: True}
    )
    mode: str | None = attrs.field(default=None, metadata={OMIT_IF_NONE: True})


def _text_format_default() -> dict[str, Any]:
    return {"type": "text"}


@attrs.frozen(kw_only=True)
class TextConfig:
    """`text`: the output format, and `verbosity` (optional on the wire, never null; OpenAI
    answers with `medium` when none is asked for)."""

    format: dict[str, Any] = attrs.field(factory=_text_format_default)
    verbosity: Literal["low", "medium", "high"] = "medium"


@attrs.frozen(kw_only=True)
class Response:
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[Item] = attrs.field(factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = attrs.field(factory=ReasoningConfig)
    store: bool = True
    temperature: float = 1.0
    text: TextConfig = attrs.field(factory=TextConfig)
    tool_choice: ToolChoice = "auto"
    tools: list[Tool] = attrs.field(factory=list)
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: Usage | None = None
    metadata: dict[str, str] = attrs.field(factory=dict)
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    background: bool = False
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = attrs.field(
        default=None, metadata={OMIT_IF_NONE: True}
    )
    # rollout extension: the request's client_metadata, kept with the response
    client_metadata: dict[str, str] | None = attrs.field(
        default=None, metadata={OMIT_IF_NONE: True}
    )


@attrs.frozen(kw_only=True)
class ResponseRef:
    """Rollout extension: a response named, not carried. A rollout's `response.done` and its
    resumed `response.in_progress` carry this instead of the response so far: the client
    already has every item (each went out as `response.output_item.done`), so a suspension
    costs the same bytes at the first tool step as at the hundredth (PROTOCOL.md RX-2.2).
    It has no `created_at`, which every full `Response` has: that tells the two apart."""

    id: str
    object: Literal["response"] = "response"
    status: ResponseStatus = "in_progress"
