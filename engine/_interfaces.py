"""The engine's injected interfaces: small `typing.Protocol`s with built-in implementations.

Long because it is a catalogue: every interface an embedder can supply, and the event types a
backend yields, each with its contract.

Each pipeline stage, the model backend, the response store and the usage ledger is one of
these; an embedding application passes its own to `open_engine()`. Data passed between them is
plain immutable values (attrs) so that stages stay independent of each other.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs
from rollout.protocol import BuiltinTool, Item, Response, Tool, ToolChoice

__all__ = [
    "ArgsDelta",
    "Backend",
    "CallEnd",
    "CallStart",
    "Classifier",
    "ClassifierVerdict",
    "ClosableBackend",
    "Finish",
    "Flag",
    "Holder",
    "HostedCall",
    "HostedTool",
    "ItemLookupStore",
    "ParamCheckingBackend",
    "Prefilled",
    "ReasoningDone",
    "Renderer",
    "ResponseStore",
    "SampleEvent",
    "SampleRequest",
    "SnapshotClassifier",
    "StoredResponse",
    "TextDelta",
    "TextEnd",
    "TextStart",
    "Tokenizer",
    "Tokens",
    "UsageLedger",
    "UsageRecord",
]

# Rendered tokens: a compact array of unsigned 32-bit token ids.
Tokens: TypeAlias = "array[int]"


def tokens(values: Sequence[int] = ()) -> array[int]:
    return array("I", values)


# --- render ----------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """Text -> token ids (o200k_base by default), offline."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class Renderer(Protocol):
    """Items -> tokens with a chat template.

    Rendering is per item and context-free: `render_item` depends on the item alone (never on
    ids such as `call_id` or item `id`, so the same conversation renders the same whatever ids
    were generated), and a context is `render_prefix(...) + concat(render_item(i) for i)`.
    Hence `render(history + new) == render(history) + render(new)` holds exactly.

    `template_id` names the chat template: compaction snapshots hold rendered tokens and are
    refused by a renderer with another template.

    A request bringing much new text is rendered in a worker thread while the event loop
    renders others (`Engine.prerender_off_loop`): rendering must not change shared state
    other than caches that stay correct under concurrent use.
    """

    @property
    def template_id(self) -> str: ...

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]: ...

    def render_item(self, item: Item) -> array[int]: ...

    def prefix_text(self, instructions: str | None, tools: Sequence[Tool]) -> str:
        """The text classifiers see for the prefix."""
        ...

    def item_text(self, item: Item) -> str:
        """The text classifiers see for an item (its content, arguments or output)."""
        ...


# --- classify --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Flag:
    """A classifier's finding that fails the response. `message` must not echo the secret."""

    classifier: str
    category: str
    message: str


@attrs.frozen(kw_only=True)
class ClassifierVerdict:
    """The next state, the flags, and the characters of the text the classifier actually
    examined (its work: the engine counts it, so a classifier that skips input shows)."""

    state: Any
    flags: tuple[Flag, ...] = ()
    scanned: int = 0


class Classifier(Protocol):
    """A safety classifier with incremental state.

    `feed` is a pure function: folding `feed` over N texts one at a time gives the same state
    (and the same flags, in order) as folding it over the same texts in any grouping, so the
    state after N items equals the state from classifying them at once. States are immutable
    and comparable with `==`. A request bringing much new text is classified in a worker
    thread (`Engine.prerender_off_loop`): `feed` must not touch shared state.
    """

    name: str

    def initial(self) -> Any: ...

    def feed(self, state: Any, text: str, n_tokens: int) -> ClassifierVerdict: ...


@runtime_checkable
class SnapshotClassifier(Classifier, Protocol):
    """Optional capability: a classifier whose state converts to plain data and back, so a
    compaction snapshot carries it (without it, a restored conversation is classified again)."""

    def encode_state(self, state: Any) -> Any: ...

    def decode_state(self, data: Any) -> Any: ...


# --- sample ----------------------------------------------------------------------------------


class Holder:
    """A scope that keeps a backend's state for a conversation between its turns: a rollout in
    flight (from its first turn to its end, suspensions included) or a WebSocket lane (its
    latest response, until the connection closes). A backend keeps something (a model's KV
    sequence) under a key of its own with a release callback; the engine releases the
    holder when the scope ends, which calls them. A released holder keeps nothing more."""

    __slots__ = ("_kept", "closed", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self._kept: dict[object, Callable[[], None]] = {}

    def __repr__(self) -> str:
        return f"Holder({self.name!r}{', closed' if self.closed else ''})"

    def keep(self, key: object, release: Callable[[], None]) -> bool:
        """Keep something under `key` (once per key: a later call replaces the callback).
        False when the holder is already closed (the caller releases it at once)."""
        if self.closed:
            return False
        self._kept[key] = release
        return True

    def release(self) -> None:
        """The scope ended: what the holder keeps is released (once), and it keeps nothing
        more."""
        self.closed = True
        kept, self._kept = self._kept, {}
        for release in kept.values():
            release()


@attrs.frozen(kw_only=True)
class SampleRequest:
    """What a backend needs to sample one turn. `context_digest` identifies the whole rendered
    context (prefix and items, independent of ids) and is maintained incrementally."""

    model: str
    params: dict[str, str]
    context_digest: bytes
    context_tokens: int
    items: Sequence[Item]  # the whole conversation so far (a view; do not copy on hot paths)
    instructions: str | None
    tools: Sequence[Tool]  # the tools offered to the model
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    max_output_tokens: int | None
    temperature: float
    top_p: float
    calls_since_user: int
    media_since_user: tuple[int, int] = (0, 0)  # (images, files) in the current user turn
    text_format: dict[str, Any] | None = None  # `text.format` of the request ({"type": ...})
    # The rendered context, for backends that evaluate tokens themselves (views: never mutate;
    # only the first `n_item_tokens` of `item_tokens` are this context's).
    prefix_tokens: array[int] = attrs.field(factory=lambda: array("I"))
    item_tokens: array[int] = attrs.field(factory=lambda: array("I"))
    n_item_tokens: int = 0
    owner: str | None = None  # whose conversation (backend caches are scoped by owner)
    # Scopes that may keep backend state between turns: the rollout's, then the lane's.
    holders: tuple[Holder, ...] = ()
    seed: int | None = None  # for sampling with temperature > 0
    # Reports a backend's own stage, in seconds, to the engine's stage timer (an upstream's
    # `upstream_encode` and `upstream_send`: `_counters.STAGES`).
    observe: Callable[[str, float], None] | None = None
    # What a backend derives from the conversation and keeps for its next turn, by the
    # backend's own key (an upstream's encoded chat messages): the lineage's, shared by every
    # state of the conversation (None: nothing is kept, the backend derives it each turn).
    derived: dict[str, Any] | None = None

    def context(self) -> array[int]:
        """The rendered context as one array (a copy, at memory speed)."""
        out = array("I", self.prefix_tokens)
        out.extend(self.item_tokens[: self.n_item_tokens])
        return out


@attrs.frozen
class TextStart:
    pass


@attrs.frozen
class TextDelta:
    text: str
    n_tokens: int = 1


@attrs.frozen
class TextEnd:
    pass


@attrs.frozen
class CallStart:
    """A tool call begins. `kind` is the tool's kind: a function or custom tool (`name` is
    its name, `namespace` its namespace), or a client-run built-in tool (`name` is its type)."""

    name: str
    namespace: str | None = None
    # "function", "custom", a client-run built-in kind ("shell", ...), or the type of a hosted
    # tool the engine runs itself (one with a configured `HostedTool`)
    kind: str = "function"


@attrs.frozen
class ArgsDelta:
    """More of the open call: JSON arguments (function), free-form input (custom), or the
    JSON action / operation of a built-in tool's call (`shell`: `{"commands": [...]}`,
    `local_shell`: `{"type": "exec", "command": [...]}`, `apply_patch`: `{"type":
    "create_file" | "update_file" | "delete_file", "path", "diff"}`, `computer`: one action
    such as `{"type": "screenshot"}`)."""

    text: str
    n_tokens: int = 1


@attrs.frozen
class CallEnd:
    pass


@attrs.frozen
class ReasoningDone:
    """A finished reasoning item (not streamed): its summary text and, as the API returns it
    with `include: ["reasoning.encrypted_content"]`, opaque `encrypted_content`; `n_tokens`
    count as output tokens."""

    summary: str
    encrypted_content: str | None = None
    n_tokens: int = 1


@attrs.frozen
class Prefilled:
    """The model evaluated `n_tokens` tokens of context for this turn (a prompt chunk, or a
    sampled token fed back): the work a cache of evaluated context (KV) spares. Counted in
    `tokens_prefilled`."""

    n_tokens: int


@attrs.frozen
class Finish:
    reason: Literal["stop", "tool_calls", "max_output_tokens"] = "stop"
    # Token counts the backend measured (an upstream server's usage); None: render and count.
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # of input_tokens, served from the upstream's own cache
    # The output count is an estimate: an upstream that reported no usage, for a model without
    # its own tokenizer (the models file's `tokenizer`: with one, `output_tokens` is its count
    # of the output text); its deltas counted, a chunk each; counted in `usage_estimated`.
    estimated: bool = False


SampleEvent: TypeAlias = (
    TextStart
    | TextDelta
    | TextEnd
    | CallStart
    | ArgsDelta
    | CallEnd
    | ReasoningDone
    | Prefilled
    | Finish
)


class Backend(Protocol):
    """A model. `sample` yields one turn's output as a stream of events: items open and close
    in order (TextStart/TextDelta*/TextEnd, CallStart/ArgsDelta*/CallEnd), then one Finish.
    Failures raise `BackendError`. Pacing (time to first token, tokens per second) happens
    inside, on trio's clock."""

    def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]: ...


@runtime_checkable
class ParamCheckingBackend(Backend, Protocol):
    """Optional capability: a backend that checks a model string's parameters
    (`name:key=value,...`) when the route is resolved, before the response starts. Raises
    `RemoteProtocolError` (400, param `model`) for bad ones."""

    def check_params(self, params: Mapping[str, str]) -> None: ...


@runtime_checkable
class ClosableBackend(Backend, Protocol):
    """Optional capability: a backend holding resources (a connection pool), closed with the
    model registry."""

    async def aclose(self) -> None: ...


# --- hosted tools ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class HostedCall:
    """A call the model made to a hosted tool: its declaration, the model's arguments (JSON
    text, e.g. `{"query": "..."}`), and the call id the engine gave it."""

    tool: BuiltinTool
    arguments: str
    call_id: str


class HostedTool(Protocol):
    """Runs a hosted tool (`web_search`, `file_search`, `code_interpreter`, `mcp`, ...) on
    the server, inside the response: the model's call is not sent to the client; the items
    `run` returns (e.g. a completed `web_search_call`) go out as output items and the model
    samples again. A hosted tool type is offered to the model only when one is configured.
    Failures raise (the response fails with `server_error`)."""

    type: str

    async def run(self, call: HostedCall) -> Sequence[Item]: ...


# --- post-inference: store and ledger --------------------------------------------------------


@attrs.frozen(kw_only=True)
class StoredResponse:
    """A response as persisted. `items` holds the conversation items this response added
    (its new input then its output) when `parent_id` is set and the parent is stored;
    otherwise (`parent_id` None, or `is_root`) the whole conversation up to and including its
    output, so hydration can always rebuild the context by walking parents to a root."""

    response: Response
    items: list[Item]
    instructions: str | None
    tools: list[Tool]
    parent_id: str | None
    is_root: bool
    owner: str | None
    # The rendering of `items` (tokens, classifier state, ...: `_segments.py`), so hydration
    # renders nothing; None when not kept (hydration then renders `items`).
    rendered: bytes | None = None


class ResponseStore(Protocol):
    """Durable storage of responses with `store=true` (SQLite by default; a shared PostgreSQL
    serves several rollout processes behind a load balancer)."""

    async def put(self, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str, *, owner: str | None) -> StoredResponse | None: ...

    async def delete(self, response_id: str, *, owner: str | None) -> bool: ...

    async def get_chain(self, response_id: str, *, owner: str | None) -> list[StoredResponse]:
        """The response and its ancestors (following `parent_id`) up to the first root, newest
        first. Raises LookupError when one of them is missing or owned by someone else."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ItemLookupStore(ResponseStore, Protocol):
    """Optional capability: find an item of a stored response by its id (`item_reference`
    input items). Without it, only items of responses still queued for writing are found."""

    async def get_item(self, item_id: str, *, owner: str | None) -> Item | None: ...


@attrs.frozen(kw_only=True)
class UsageRecord:
    """One sampling step's usage. `(response_id, step)` is unique: recording is idempotent."""

    response_id: str
    step: int
    owner: str | None
    model: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    complete: bool  # False: the step was interrupted (disconnect, cancel); work still counts
    created_at: float


class UsageLedger(Protocol):
    """Durable usage accounting. `record` must be idempotent on `(response_id, step)`."""

    async def record(self, records: Sequence[UsageRecord]) -> None: ...

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        """Blocking variant, called only when the engine itself is torn down (its writer
        cancelled) for the usage still queued; never while connections are served."""
        ...

    async def aclose(self) -> None: ...
