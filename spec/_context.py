"""What a check runs with: the options, the case list, a `Context` (connections, HTTP,
probes of the server's features), and `CheckSet`, how a module registers its checks.

Long because a check's context probes the server's features once (lanes, steering, slow models,
limits) and shares connections across checks.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from ._client import (
    CheckFailed,
    CheckSkipped,
    HttpResult,
    SseEvent,
    UpgradeRefused,
    WsClient,
    describe_value,
    http_request,
    http_sse,
    open_ws,
    ws_url_of,
)

__all__ = [
    "Answer",
    "Case",
    "CheckFn",
    "CheckSet",
    "Context",
    "Options",
    "Probes",
    "Profile",
    "load_cases",
    "load_profiles",
]

# The default model id: rollout's built-in simulated model. Any other server needs --model.
DEFAULT_MODEL = "sim"
# The default slow model with the default model: rollout's sim, its first token after 0.4 s and
# its output at 200 tokens a second, slow enough for the checks that act while a response is
# sampling (queueing, early appends, steering). The help and the skip messages name it.
DEFAULT_SLOW_MODEL = "sim:ttft_ms=400,tps=200"
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
    # act while a response is still sampling; defaults to `DEFAULT_SLOW_MODEL` with the
    # default model, else to `model` (`slow`).
    slow_model: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    concurrency: int = DEFAULT_CONCURRENCY
    filter: tuple[str, ...] = ()
    # Only the checks of these profiles (`--profile`; all of them when empty).
    profiles: tuple[str, ...] = ()
    age_limit_seconds: float | None = None
    max_message_size: int | None = None
    max_queued_creates: int | None = None
    rollout_suspend_limit: float | None = None
    # Profiles (or features) the server must support: one that is not supported, or whose
    # probe could not run, fails the run (`--require`).
    require: tuple[str, ...] = ()
    quiet_seconds: float = DEFAULT_QUIET_SECONDS

    @property
    def slow(self) -> str:
        """The slow model the checks use: `slow_model`, else `DEFAULT_SLOW_MODEL` with the
        default model (rollout's sim), else `model`."""
        if self.slow_model:
            return self.slow_model
        return DEFAULT_SLOW_MODEL if self.model == DEFAULT_MODEL else self.model

    def __attrs_post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.quiet_seconds <= 0:
            raise ValueError(f"quiet_seconds must be positive, got {self.quiet_seconds}")


@attrs.frozen(kw_only=True)
class Case:
    """One entry of checks.json; `profile` is the profile of its feature."""

    id: str
    rule: str
    title: str
    feature: str
    required: bool
    needs: tuple[str, ...] = ()
    profile: str = "core"


@attrs.frozen(kw_only=True)
class Profile:
    """A group of checks a server implements as a whole (checks.json's `profiles`): `core`,
    which every server must pass, and the optional ones, each found out by its features'
    probes before its checks run. `probe` says what the probe sends (None: no probe)."""

    name: str
    title: str
    features: tuple[str, ...]
    probe: str | None = None


def _case_list() -> dict[str, Any]:
    text = (
        importlib.resources.files("rollout.spec")
        .joinpath("checks.json")
        .read_text(encoding="utf-8")
    )
    data: dict[str, Any] = json.loads(text)
    return data


def load_profiles() -> list[Profile]:
    """The profiles, `core` first, in the order of spec/checks.json."""
    return [
        Profile(
            name=p["name"],
            title=p["title"],
            features=tuple(p["features"]),
            probe=p.get("probe"),
        )
        for p in _case_list()["profiles"]
    ]


def load_cases() -> list[Case]:
    """The case list shipped beside the specification (spec/checks.json)."""
    data = _case_list()
    profile_of = {f: p["name"] for p in data["profiles"] for f in p["features"]}
    return [
        Case(
            id=c["id"],
            rule=c["rule"],
            title=c["title"],
            feature=c["feature"],
            required=bool(c["required"]),
            needs=tuple(c.get("needs", ())),
            profile=profile_of[c["feature"]],
        )
        for c in data["checks"]
    ]


# The probes whose value is a bool (the others are feature probes: None when the server
# supports the feature, else why not).
VALUE_PROBES = ("deterministic",)
# Every feature probe `Probes.known` reports, probed or not.
FEATURES = ("rollout", "lanes", "steer", "multi_agent", "auth")


class ProbeFailed(CheckFailed):
    """A probe could not find out what the server does (the server failed it); `cause` is
    the answer behind the failure when one stands out (see `Answer`)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class Probes:
    """What the server supports, found out once per run and shared by the checks."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._results: dict[str, tuple[Any, str | None, str | None]] = {}

    def known(self) -> dict[str, bool | None]:
        """What was found: a feature probe's value is None (supported) or why not (a string);
        other probes answer a bool. None here: not probed, or the probe failed."""
        out: dict[str, bool | None] = {name: None for name in (*FEATURES, *VALUE_PROBES)}
        for name, (value, error, _) in self._results.items():
            if error is not None:
                out[name] = None
            elif isinstance(value, bool):
                out[name] = value
            else:
                out[name] = value is None
        return out

    def findings(self) -> dict[str, tuple[bool | None, str, str | None]]:
        """Each feature probe that ran: (supported: True, False, or None when the probe
        failed; the evidence or the probe's failure; the cause of that failure, if any)."""
        out: dict[str, tuple[bool | None, str, str | None]] = {}
        for name, (value, error, cause) in self._results.items():
            if name in VALUE_PROBES:
                continue
            if error is not None:
                out[name] = (None, error, cause)
            else:
                out[name] = (value is None, value or "", None)
        return out

    async def get(
        self,
        name: str,
        run: Callable[[], Awaitable[Any]],
        cause: Callable[[str], str | None] | None = None,
    ) -> Any:
        """The probe's value; a probe that failed raises `ProbeFailed` for every check that
        asks for it, with the probe's reason (it is not re-run against a server that just
        failed it). `cause` names the answer behind a failure (from the prober's context)."""
        async with self._lock:
            if name not in self._results:
                try:
                    self._results[name] = (await run(), None, None)
                except CheckFailed as exc:
                    why = str(exc)
                    self._results[name] = (None, why, cause(why) if cause else None)
        value, error, why_cause = self._results[name]
        if error is not None:
            raise ProbeFailed(f"the {name} probe failed: {error}", why_cause)
        return value


@attrs.frozen
class Answer:
    """An error answer the server gave a check: an HTTP status and body (of a request or of a
    refused WebSocket upgrade: the same status and body are the same answer), or a WebSocket
    `error` event (its status and `error` object). When a failed check saw one answer only,
    and its reason names it, that answer is the failure's cause; checks failed by the same
    cause are reported as one (`Report.causes`)."""

    status: int | None
    body: str
    event: bool = False

    @classmethod
    def of(cls, status: int, body: str) -> Answer:
        """An HTTP answer; a JSON body is compared as its value (spacing and key order aside)."""
        try:
            body = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
        return cls(status, body)

    def describe(self) -> str:
        if self.event:
            return f"error event (status {self.status}) {describe_value(self.body)}"
        return f"HTTP {self.status} {describe_value(' '.join(self.body.split()))}"

    def named_by(self, reason: str) -> bool:
        """Whether a failure's reason names this answer (its status, or its error code)."""
        if self.status is not None and re.search(rf"\b{self.status}\b", reason):
            return True
        if self.event:
            try:
                code = json.loads(self.body).get("code")
            except (ValueError, AttributeError):
                return False
            return isinstance(code, str) and bool(code) and code in reason
        return False


def cause_of(answers: Sequence[Answer], reason: str) -> str | None:
    """The answer behind a failure: the one distinct error answer of the check, when its
    reason names it; else None."""
    distinct = set(answers)
    if len(distinct) != 1:
        return None
    (answer,) = distinct
    return answer.describe() if answer.named_by(reason) else None


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
        # The error answers the server gave this check (`Answer`), in order.
        self.answers: list[Answer] = []
        self._http = http

    def note_error_event(self, event: Mapping[str, Any]) -> None:
        """A WebSocket `error` event received (see `Answer`)."""
        status = event.get("status")
        error = event.get("error")
        body = json.dumps(error if error is not None else event, sort_keys=True)
        self.answers.append(Answer(status if isinstance(status, int) else None, body, event=True))

    def cause(self, reason: str) -> str | None:
        """The answer behind a failure with this reason (`cause_of`)."""
        return cause_of(self.answers, reason)

    # --- options ---
    def weaken(self, why: str) -> None:
        """This check could only verify structure (`why`): it ends WEAK, never PASSED."""
        self.weak.append(why)

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def slow_model(self) -> str:
        return self.options.slow

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
        return self._open_ws(ws_url_of(self.base_url, query), merged)

    @asynccontextmanager
    async def _open_ws(self, url: str, headers: Mapping[str, str]) -> AsyncIterator[WsClient]:
        opened = False
        try:
            async with open_ws(
                url, headers=headers, limit=self.timeout, on_error=self.note_error_event
            ) as ws:
                opened = True
                yield ws
        except UpgradeRefused as exc:
            if not opened:
                self.answers.append(Answer.of(exc.status, exc.body))
            raise

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
        result = await http_request(
            self._http,
            method,
            self.base_url + path,
            limit=self.timeout,
            json_body=json_body,
            content=content,
            headers=merged,
        )
        self._note(result)
        return result

    def _note(self, result: HttpResult) -> None:
        if result.status >= 400:
            self.answers.append(Answer.of(result.status, result.text))

    async def sse(self, body: Mapping[str, Any]) -> tuple[HttpResult, list[SseEvent]]:
        self.step = "POST /responses (stream)"
        result, events = await http_sse(
            self._http,
            self.base_url + "/responses",
            body,
            limit=self.timeout,
            headers=self.auth_headers(),
        )
        self._note(result)
        return result, events

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
