"""What a check runs with: the options, the case list, a `Context` (connections, HTTP,
probes of the server's features), and `CheckSet`, how a module registers its checks."""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import httpx
import trio

from ._client import (
    CheckFailed,
    CheckSkipped,
    HttpResult,
    SseEvent,
    WsClient,
    http_request,
    http_sse,
    open_ws,
    ws_url_of,
)

__all__ = [
    "Case",
    "CheckFn",
    "CheckSet",
    "Context",
    "Options",
    "Probes",
    "load_cases",
]

# The default model id: rollout's built-in simulated model. Any other server needs --model.
DEFAULT_MODEL = "sim"
# Default deadline of one check, in seconds (a real model may need several responses).
DEFAULT_TIMEOUT = 60.0
# Checks run at once by default. Each holds at most a few connections.
DEFAULT_CONCURRENCY = 4
# How long "nothing arrives" is observed, in seconds: long enough for a frame already on its
# way over a network to arrive.
DEFAULT_QUIET_SECONDS = 0.3
# Options a case may need (`needs` in checks.json) -> the command-line flag that sets it.
OPTION_FLAGS = {
    "api_key": "--api-key",
    "age_limit_seconds": "--age-limit-seconds",
    "max_message_size": "--max-message-size",
    "max_queued_creates": "--max-queued-creates",
    "rollout_suspend_limit": "--rollout-suspend-limit",
}


@attrs.frozen(kw_only=True)
class Options:
    """How to run the checks. Options describing the server's configuration enable the checks
    that need them; without one those checks are skipped."""

    api_key: str | None = None
    model: str = DEFAULT_MODEL
    # A model whose first output takes a noticeable time (>= 0.2 s), for the checks that must
    # act while a response is still sampling; defaults to `model`.
    slow_model: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    concurrency: int = DEFAULT_CONCURRENCY
    filter: tuple[str, ...] = ()
    age_limit_seconds: float | None = None
    max_message_size: int | None = None
    max_queued_creates: int | None = None
    rollout_suspend_limit: float | None = None
    require: tuple[str, ...] = ()
    quiet_seconds: float = DEFAULT_QUIET_SECONDS

    def __attrs_post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.quiet_seconds <= 0:
            raise ValueError(f"quiet_seconds must be positive, got {self.quiet_seconds}")


@attrs.frozen(kw_only=True)
class Case:
    """One entry of checks.json."""

    id: str
    rule: str
    title: str
    feature: str
    required: bool
    needs: tuple[str, ...] = ()


def load_cases() -> list[Case]:
    """The case list shipped beside the specification (spec/checks.json)."""
    text = (
        importlib.resources.files("rollout.spec")
        .joinpath("checks.json")
        .read_text(encoding="utf-8")
    )
    data = json.loads(text)
    return [
        Case(
            id=c["id"],
            rule=c["rule"],
            title=c["title"],
            feature=c["feature"],
            required=bool(c["required"]),
            needs=tuple(c.get("needs", ())),
        )
        for c in data["checks"]
    ]


class Probes:
    """What the server supports, found out once per run and shared by the checks."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._results: dict[str, tuple[Any, str | None]] = {}

    def known(self) -> dict[str, bool | None]:
        """What was found: a feature probe's value is None (supported) or why not (a string);
        other probes answer a bool. None here: not probed, or the probe failed."""
        out: dict[str, bool | None] = {
            "rollout": None,
            "lanes": None,
            "multi_agent": None,
            "deterministic": None,
        }
        for name, (value, error) in self._results.items():
            if error is not None:
                out[name] = None
            elif isinstance(value, bool):
                out[name] = value
            else:
                out[name] = value is None
        return out

    async def get(self, name: str, run: Callable[[], Awaitable[Any]]) -> Any:
        """The probe's value; a probe that failed fails every check that asks for it, with
        the probe's reason (it is not re-run against a server that just failed it)."""
        async with self._lock:
            if name not in self._results:
                try:
                    self._results[name] = (await run(), None)
                except CheckFailed as exc:
                    self._results[name] = (None, str(exc))
        value, error = self._results[name]
        if error is not None:
            raise CheckFailed(f"the {name} probe failed: {error}")
        return value


class Context:
    """Handed to each check: the server, the options and helpers to talk to it."""

    def __init__(
        self,
        base_url: str,
        options: Options,
        http: httpx.AsyncClient,
        probes: Probes,
        case: Case,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options
        self.probes = probes
        self.case = case
        self.step = ""
        # Why the check could only verify structure (`weaken`): its outcome is then WEAK.
        self.weak: list[str] = []
        self.deadline_scope: trio.CancelScope | None = None
        self._http = http

    # --- options ---
    def weaken(self, why: str) -> None:
        """This check could only verify structure (`why`): it ends WEAK, never PASSED."""
        self.weak.append(why)

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def slow_model(self) -> str:
        return self.options.slow_model or self.options.model

    @property
    def timeout(self) -> float:
        return self.options.timeout

    @property
    def quiet(self) -> float:
        return self.options.quiet_seconds

    def allow(self, seconds: float) -> None:
        """Extend this check's deadline for a wait that is part of the check (an age limit)."""
        if self.deadline_scope is not None:
            self.deadline_scope.deadline += seconds

    def auth_headers(self) -> dict[str, str]:
        key = self.options.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # --- transports ---
    def ws(
        self,
        *,
        headers: Mapping[str, str] | None = None,
        query: Mapping[str, str] | None = None,
        auth: bool = True,
    ) -> AbstractAsyncContextManager[WsClient]:
        self.step = "opening a WebSocket"
        merged = {**(self.auth_headers() if auth else {}), **(headers or {})}
        return open_ws(ws_url_of(self.base_url, query), headers=merged, limit=self.timeout)

    async def http(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        auth: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> HttpResult:
        self.step = f"{method} {path}"
        merged = {**(self.auth_headers() if auth else {}), **(headers or {})}
        if content is not None:
            merged.setdefault("Content-Type", "application/json")
        return await http_request(
            self._http,
            method,
            self.base_url + path,
            limit=self.timeout,
            json_body=json_body,
            content=content,
            headers=merged,
        )

    async def sse(self, body: Mapping[str, Any]) -> tuple[HttpResult, list[SseEvent]]:
        self.step = "POST /responses (stream)"
        return await http_sse(
            self._http,
            self.base_url + "/responses",
            body,
            limit=self.timeout,
            headers=self.auth_headers(),
        )

    def need(self, option: str) -> Any:
        value = getattr(self.options, option)
        if value is None:
            raise CheckSkipped(f"needs {OPTION_FLAGS.get(option, option)}")
        return value


CheckFn = Callable[[Context], Awaitable[None]]


class CheckSet:
    """The checks of one module by id; `@checks("http.create")` registers a function (its
    rule and title live in checks.json). `_catalog` gathers the sets."""

    def __init__(self) -> None:
        self.by_id: dict[str, CheckFn] = {}

    def add(self, check_id: str, fn: CheckFn) -> None:
        if check_id in self.by_id:
            raise ValueError(f"check {check_id!r} is registered twice")
        self.by_id[check_id] = fn

    def __call__(self, check_id: str) -> Callable[[CheckFn], CheckFn]:
        def register(fn: CheckFn) -> CheckFn:
            self.add(check_id, fn)
            return fn

        return register
