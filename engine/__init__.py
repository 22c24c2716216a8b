"""rollout's engine: pipeline stages, caches, the rollout coroutine, backends, stores, server.

The embedded API: `open_engine()` gives an `Engine`; `engine.session()` gives a connection
scope whose `create()` runs a response (stateless or continuing with previous_response_id) and
whose `open_rollout()` runs the rollout extension.

The rooms: `_engine` (the shared engine), `_session` (a connection: parents), `_preinfer`
(pre-inference), `_rollout` (the coroutine: sample, suspend, resume, one exit), `_suspend` (the
handle appends go through), `_steer` / `_steered` (steering, and a steered response's successors),
`_sink` (where a response's events go), `_sampling` (one turn), `_pipeline` / `_validate` /
`_render` / `_classify` (the stages), `_cache` (a connection's responses), `_render_cache` /
`_itemkey` (conversations rendered once, for every connection), `_segments` (renderings kept with
stored responses), `_postinfer` (the writer), `_store` / `_memory` / `_ledger` (durability), `_app`
and its `_responses_api` / `_chat_api` / `_asgi` / `_auth` / `_metrics` / `_http_stream` (HTTP),
`_ws` (WebSocket mode) and its `_lanes` / `_deliveries` / `_outbox`, `_serve` (hypercorn) with
`_warmup` and `_logging` and the patches of what it serves with (`_write`, `_read`, `_h11_body`,
`_http_limits`, `_deflate`, `_ws_deflate`, `_ws_mask`), `_sim` / `_upstream` / `_chat`
(backends); `_llama_vocab` / `_template` / `_toolconv` (a llama.cpp model's own tokens, chat
template and tool-call convention: the `llama` extra, never imported here, so the engine runs
without llama-cpp-python).
"""

from ._classify import (
    ClassifierSet,
    PatternPolicy,
    PolicyRule,
    SecretDetector,
    default_classifiers,
)
from ._config import ConfigError, load_registry, registry_from_mapping
from ._counters import Counters
from ._defaults import default_registry
from ._engine import (
    DEFAULT_CACHE_RESPONSES,
    DEFAULT_CACHE_TOKENS,
    DEFAULT_ROLLOUT_SUSPEND_LIMIT,
    Emit,
    Engine,
    ResponseCache,
    Rollout,
    Session,
    open_engine,
)
from ._errors import BackendError, EngineError
from ._interfaces import (
    Backend,
    Classifier,
    ClassifierVerdict,
    Flag,
    HostedCall,
    HostedTool,
    Renderer,
    ResponseStore,
    SampleEvent,
    SampleRequest,
    StoredResponse,
    Tokenizer,
    UsageLedger,
    UsageRecord,
)
from ._ledger import MemoryUsageLedger, SQLiteUsageLedger, open_sqlite_ledger
from ._memory import MemoryResponseStore
from ._models import ModelRegistry, ModelSpec
from ._pg import StoreError
from ._pg_ledger import PostgresUsageLedger, open_postgres_ledger
from ._pg_store import PostgresResponseStore, open_postgres_store
from ._render import ChatTemplateRenderer
from ._render_cache import DEFAULT_RENDER_CACHE_BYTES, DEFAULT_RENDER_CACHE_TTL, RenderCache
from ._serve import ServerConfig, open_server, serve
from ._sim import SimBackend
from ._state import ResponseState
from ._store import SQLiteResponseStore, open_sqlite_store
from ._tokenizer import O200kTokenizer
from ._upstream import UpstreamBackend, UpstreamConfig
from ._validate import ConversationValidator, Validator
from ._ws import WebSocketLimits

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CACHE_RESPONSES",
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_RENDER_CACHE_BYTES",
    "DEFAULT_RENDER_CACHE_TTL",
    "DEFAULT_ROLLOUT_SUSPEND_LIMIT",
    "Backend",
    "BackendError",
    "ChatTemplateRenderer",
    "Classifier",
    "ClassifierSet",
    "ClassifierVerdict",
    "ConfigError",
    "ConversationValidator",
    "Counters",
    "Emit",
    "Engine",
    "EngineError",
    "Flag",
    "HostedCall",
    "HostedTool",
    "MemoryResponseStore",
    "MemoryUsageLedger",
    "ModelRegistry",
    "ModelSpec",
    "O200kTokenizer",
    "PatternPolicy",
    "PolicyRule",
    "PostgresResponseStore",
    "PostgresUsageLedger",
    "RenderCache",
    "Renderer",
    "ResponseCache",
    "ResponseState",
    "ResponseStore",
    "Rollout",
    "SQLiteResponseStore",
    "SQLiteUsageLedger",
    "SampleEvent",
    "SampleRequest",
    "SecretDetector",
    "ServerConfig",
    "Session",
    "SimBackend",
    "StoreError",
    "StoredResponse",
    "Tokenizer",
    "UpstreamBackend",
    "UpstreamConfig",
    "UsageLedger",
    "UsageRecord",
    "Validator",
    "WebSocketLimits",
    "default_classifiers",
    "default_registry",
    "load_registry",
    "open_engine",
    "open_postgres_ledger",
    "open_postgres_store",
    "open_server",
    "open_sqlite_ledger",
    "open_sqlite_store",
    "registry_from_mapping",
    "serve",
]
