"""What a connection and the rollout coroutine need from the engine, as Protocols.

The session (`_session.py`), pre-inference (`_preinfer.py`), the coroutine (`_rollout.py`), one
sampling turn (`_sampling.py`) and the suspension handle (`_suspend.py`) sit below the engine in
the import order (the engine opens sessions): they see these views, which `Engine` and
`Session` satisfy, instead of importing them back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol, TypeVar

import trio
from rollout.protocol import Item, ResponseCreate

from ._cache import ResponseCache
from ._compact import SnapshotSeal
from ._counters import Counters, StageTimer
from ._interfaces import Holder, HostedTool, StoredResponse
from ._models import Router
from ._pipeline import Pipeline, Prerendered
from ._postinfer import PostInference
from ._render_cache import RenderCache
from ._state import Prefix, ResponseState, Route

_Raw = TypeVar("_Raw", str, bytes)
_Decoded = TypeVar("_Decoded")

__all__ = ["ConnectionScope", "EngineServices"]


class EngineServices(Protocol):
    """The shared machinery a response uses (an `Engine`)."""

    @property
    def counters(self) -> Counters: ...
    @property
    def pipeline(self) -> Pipeline: ...
    @property
    def router(self) -> Router: ...
    @property
    def hosted(self) -> dict[str, HostedTool]: ...
    @property
    def post(self) -> PostInference: ...
    @property
    def render_cache(self) -> RenderCache: ...
    @property
    def seal(self) -> SnapshotSeal: ...
    @property
    def wall_clock(self) -> Callable[[], float]: ...
    @property
    def rollout_suspend_limit(self) -> float: ...

    @property
    def timer(self) -> StageTimer: ...
    @property
    def draining(self) -> bool: ...

    def now(self) -> int: ...

    def interruptible(self) -> AbstractContextManager[trio.CancelScope]: ...

    def record_status(self, status: str) -> None: ...

    def empty_state(self) -> ResponseState: ...

    def decode(
        self,
        decode: Callable[[_Raw], _Decoded],
        data: _Raw,
        timings: dict[str, float] | None = None,
    ) -> Awaitable[_Decoded]: ...

    def decode_create(
        self,
        decode: Callable[[_Raw], _Decoded],
        data: _Raw,
        *,
        owner: str | None,
        kind: Literal["body", "event"],
        max_size: int,
        timings: dict[str, float] | None = None,
    ) -> Awaitable[_Decoded | ResponseCreate]: ...

    async def validate_off_loop(
        self,
        request: ResponseCreate,
        *,
        tools_known: bool,
        timings: dict[str, float] | None = None,
    ) -> bool: ...

    async def prerender_off_loop(
        self,
        request: ResponseCreate,
        route: Route,
        *,
        known_prefix: Prefix | None,
        root: ResponseState,
        items: Sequence[Item],
        timings: dict[str, float] | None = None,
    ) -> Prerendered | None: ...

    async def stored_chain(
        self, response_id: str, *, owner: str | None
    ) -> list[StoredResponse]: ...

    async def get_stored(self, response_id: str, *, owner: str | None) -> StoredResponse | None: ...

    async def find_stored_item(self, item_id: str, *, owner: str | None) -> Item | None: ...


class ConnectionScope(Protocol):
    """The connection a response runs on (a `Session`)."""

    @property
    def engine(self) -> EngineServices: ...
    @property
    def owner(self) -> str | None: ...
    @property
    def cache(self) -> ResponseCache: ...

    last_timings: dict[str, float]

    def lane_holder(self, lane: str | None) -> Holder | None:
        """What keeps backend state for a lane's next turn (WebSocket connections), or None."""
        ...
