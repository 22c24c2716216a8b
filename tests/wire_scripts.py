"""Agent scripts run every way a client can run them, as a real client does: JSON over a real
socket (trio-websocket, httpx) to a rollout server. One interpreter, one strategy; the server
behind the URL is the only thing that varies (`Host`): one served in this process on a
loopback port (fast: many examples), or a `rollout serve` subprocess (tests/wire_server.py).

The ways (`MODES`); each runs the same script, user turn by user turn:

| mode           | transport  | how the agent loop continues                                       |
|----------------|------------|--------------------------------------------------------------------|
| rollout        | WebSocket  | `rollout: true`; `response.done`, then the outputs are appended    |
|                |            | (`response.append`), in parts and out of order; one response a turn|
| inject         | WebSocket  | the multi-agent beta (`OpenAI-Beta` at the handshake,              |
|                |            | `multi_agent`); the outputs injected (`response.inject`) in parts  |
|                |            | and out of order once the step's calls are done (the sim's `steps` |
|                |            | and `parallel` say how many a step makes); one response a turn     |
| ws_chain       | WebSocket  | `previous_response_id`, one create per step                        |
| ws_resend      | WebSocket  | the whole history on every create (no previous id, `store: false`) |
| http_stateless | HTTP       | the whole history on every `POST /v1/responses` (`store: false`)   |
| http_chain     | HTTP       | `previous_response_id` with `store: true` (every request resolves  |
|                |            | it through the store: the render cache's copy, else hydration)     |
| restart        | WebSocket  | `ws_chain` with `store: true`, and the server restarted (SIGTERM   |
|                |            | or SIGKILL, after a terminal event) at a drawn response: the chain |
|                |            | continues on a new connection to the new process, same data dir    |

Each mode runs as its own tenant (an API key of its own), so no mode reuses another's
renderings (the render cache) or stored responses: a bug in one mode cannot hide by leaking
into another.

Every script's features run in every mode (a user turn is a new create or a new rollout in
each, so the model, tools, instructions and `max_output_tokens` can change at user turns):
- tool calls of every kind a client runs (function, custom text/regex/lark, shell,
  local_shell, apply_patch, computer), parallel calls, several steps, tool outputs up to
  tens of kilobytes; the outputs of a step are delivered in a drawn order (the same order
  in every mode: a chain sends them in one input; a rollout appends, an inject injects, them
  in drawn parts);
- several user turns, with media parts (input_image, input_file);
- `max_output_tokens` cut-offs: the response ends incomplete; the calls it completed are
  answered at the start of the next user turn's input;
- reasoning items (`sim:reasoning=N`), echoed back by the history-resending modes (as sent,
  or bare: without ids and status);
- forks: a turn continues from the end of an earlier turn (chain modes: that response's id;
  resending modes: the history as it was then);
- compaction between turns (`POST /v1/responses/compact`, by `previous_response_id` where the
  chain is stored, else by the history): the next turn starts a new chain from the window.
Not drawn: tools or model changed inside a user turn (a rollout keeps its request's tools and
model until it ends, so only a chain could), and automatic compaction (`context_management`:
a rollout compacts once per rollout, a chain at every create, by design).

What is compared (`compare`), every mode against `ws_chain`:
- items: the model's output items in order (reasoning, messages, calls; never the client's
  tool outputs), as wire JSON without `id` and `call_id`, and without the beta's root-agent
  attribution (`agent`, an assistant message's `phase`) for `inject`;
- usage: input, output and total tokens summed over the script's responses;
- context: after the script, each mode sends one more user turn its own way (`tool_choice:
  none`) and reports its answer's text and `input_tokens`. The sim's output is a function of
  the digest of the whole rendered context and `input_tokens` is that context's length, so
  this compares the final rendered context itself (up to a digest collision), as the server
  holds it for the next request (for `http_chain` and `restart`, rebuilt from the store).
"""

from __future__ import annotations

import base64
import random
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import httpx
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.protocol import MULTI_AGENT_BETA

from tests.engine_harness import answer_item, script_tools
from tests.server_harness import WsClient, open_test_server, open_ws

__all__ = [
    "MODES",
    "MODE_KEYS",
    "AgentScript",
    "Host",
    "InProcessHost",
    "Outcome",
    "Turn",
    "agent_scripts",
    "compare",
    "describe",
    "examples",
    "open_in_process_host",
    "run_mode",
    "run_script",
    "statistics",
]

Json = dict[str, Any]
MODES = ("ws_chain", "rollout", "inject", "ws_resend", "http_stateless", "http_chain", "restart")
# Each mode runs as its own tenant (an API key of its own, so an owner of its own): no mode
# reuses another's renderings (the render cache) or stored responses.
MODE_KEYS = {mode: f"sk-equiv-{mode}" for mode in MODES}
# Tool-output sizes (characters), drawn per script and cycled over its calls.
OUTPUT_SIZES = (0, 12, 120, 1_200, 12_000, 40_000)
# The characters of all tool outputs of one script: past it, outputs are cut to 120
# characters, so that a long script of large outputs stays within the model's context window
# (400k tokens; random unicode text can take a token per character).
OUTPUT_BUDGET = 200_000
# The extra turn that reads the final context (see the module docstring).
PROBE = "Summarize what happened."
PROBE_MODEL = "sim:tokens=12"
# Responses one user turn may take (a safety net: a script needs at most `steps` + 1).
MAX_STEPS = 40
# An I/O deadline per request, well past what any drawn script needs on a loaded machine.
REQUEST_TIMEOUT = 60.0


@attrs.frozen
class Turn:
    """One user turn and the request settings it is sent with."""

    text: str
    media: tuple[Json, ...] = ()
    model: str = "sim:steps=1"
    tools: tuple[p.Tool, ...] = ()
    instructions: str | None = None
    max_output_tokens: int | None = None
    fork: int | None = None  # continue from the end of user turn `fork` (0-based), not the last
    compact: bool = False  # compact the conversation first (when no call is owed)

    def message(self) -> Json:
        if not self.media:
            return {"type": "message", "role": "user", "content": self.text}
        parts = [{"type": "input_text", "text": self.text}, *self.media]
        return {"type": "message", "role": "user", "content": parts}

    def body(self) -> Json:
        """The create fields this turn sends besides input (and previous id, store, mode)."""
        body: Json = {"model": self.model, "tools": [p.to_wire(t) for t in self.tools]}
        if self.instructions is not None:
            body["instructions"] = self.instructions
        if self.max_output_tokens is not None:
            body["max_output_tokens"] = self.max_output_tokens
        return body

    @property
    def params(self) -> dict[str, int]:
        _, _, options = self.model.partition(":")
        return {k: int(v) for k, v in (kv.split("=") for kv in options.split(",") if kv)}


@attrs.frozen
class AgentScript:
    turns: tuple[Turn, ...]
    output_texts: tuple[str, ...]  # cycled over the calls
    output_sizes: tuple[int, ...]  # cycled over the calls
    seed: int  # the order and parts in which each step's outputs are delivered
    store: bool  # `store` of the WebSocket modes but `restart` (which stores)
    bare_echo: bool  # the resending modes echo output items bare (else as received)
    restart_after: int = 1  # `restart`: after this many responses (at the latest, before the probe)
    kill: bool = False  # `restart`: SIGKILL (else SIGTERM, a graceful shutdown)

    def answer(self, call: p.ToolCall, n: int) -> Json:
        """The output a client sends for the `n`-th call of the script (of the call's kind)."""
        base = self.output_texts[n % len(self.output_texts)] or "ok"
        sizes = self.output_sizes
        size = sizes[n % len(sizes)]
        spent = sum(sizes) * (n // len(sizes)) + sum(sizes[: n % len(sizes)])
        if spent + size > OUTPUT_BUDGET:
            size = min(size, 120)
        found = p.call_of(call)
        assert found is not None
        text = f"{found[2]}#{n}:"
        if size:
            repeat = f"{base} {n}; "
            text += (repeat * (size // len(repeat) + 1))[:size]
        return typing.cast(Json, p.to_wire(answer_item(call, text, n)))

    def delivery(self, step: int, n_outputs: int) -> tuple[list[int], list[int]]:
        """The order (a permutation of call positions) and the part sizes in which the outputs
        of the script's `step`-th suspension are delivered."""
        rng = random.Random(f"{self.seed}:{step}")
        order = list(range(n_outputs))
        rng.shuffle(order)
        parts: list[int] = []
        left = n_outputs
        while left:
            size = rng.randint(1, left)
            parts.append(size)
            left -= size
        return order, parts


# --- outcomes --------------------------------------------------------------------------------


@attrs.define
class Outcome:
    """What one mode produced."""

    mode: str
    items: list[Json] = attrs.field(factory=list)
    usage: list[int] = attrs.field(factory=lambda: [0, 0, 0])
    context: tuple[int, str] = (0, "")  # the probe's input_tokens and answer
    responses: int = 0
    suspensions: int = 0  # rollout/inject: waits for outputs; chains: continued with outputs
    steps: list[int] = attrs.field(factory=list)  # sampling steps with calls, per user turn
    calls: list[int] = attrs.field(factory=list)  # calls per step that made calls
    partial: int = 0  # deliveries in more than one part
    reordered: int = 0  # deliveries in another order than the calls'
    cut_off: int = 0  # responses ended incomplete
    restarts: int = 0

    def add_response(self, response: p.Response, *, attributed: bool = False) -> None:
        self.responses += 1
        assert response.usage is not None, response
        self.usage[0] += response.usage.input_tokens
        self.usage[1] += response.usage.output_tokens
        self.usage[2] += response.usage.total_tokens
        if response.status == "incomplete":
            self.cut_off += 1
        for item in response.output:
            if p.output_of(item) is None:
                self.items.append(normalized(item, attributed=attributed))


def normalized(item: p.Item, *, attributed: bool = False) -> Json:
    wire = dict(p.to_wire(item))
    wire.pop("id", None)
    wire.pop("call_id", None)
    if attributed:
        wire.pop("agent", None)
        if wire.get("type") == "message" and wire.get("role") == "assistant":
            wire.pop("phase", None)
    return wire


def compare(outcomes: Sequence[Outcome]) -> dict[str, list[str]]:
    """Every outcome against the first: {comparison: modes that differ} for items, usage and
    context (empty when all agree)."""
    base = outcomes[0]
    found: dict[str, list[str]] = {"items": [], "usage": [], "context": []}
    for other in outcomes[1:]:
        if other.items != base.items:
            found["items"].append(other.mode)
        if other.usage != base.usage:
            found["usage"].append(other.mode)
        if other.context != base.context:
            found["context"].append(other.mode)
    return {k: v for k, v in found.items() if v}


def describe(outcomes: Sequence[Outcome], found: dict[str, list[str]]) -> str:
    base = outcomes[0]
    lines = [f"modes differ from {base.mode}: {found}"]
    for other in outcomes[1:]:
        if other.usage != base.usage:
            lines.append(f"  usage {other.mode}: {other.usage} vs {base.usage}")
        if other.context != base.context:
            lines.append(f"  context {other.mode}: {other.context} vs {base.context}")
        if other.items != base.items:
            for i, (a, b) in enumerate(zip(other.items, base.items, strict=False)):
                if a != b:
                    lines.append(f"  items {other.mode} [{i}]: {str(a)[:300]} vs {str(b)[:300]}")
                    break
            else:
                lines.append(f"  items {other.mode}: {len(other.items)} vs {len(base.items)}")
    return "\n".join(lines)


# --- hosts -----------------------------------------------------------------------------------


class Host(Protocol):
    """A rollout server reachable on loopback; `restart` replaces it with a new one on the
    same data folder (after a graceful shutdown, or killed)."""

    @property
    def url(self) -> str: ...

    async def restart(self, *, kill: bool) -> None: ...


@attrs.define
class InProcessHost:
    """A server in this process (hypercorn on a loopback port, a SQLite store in
    `data_dir`). A kill cancels it at once (nothing drains); a restart opens a new one."""

    data_dir: Path
    nursery: trio.Nursery
    url: str = ""
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _cancel: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _done: trio.Event = attrs.field(factory=trio.Event)

    async def start(self) -> None:
        self._stop, self._done = trio.Event(), trio.Event()
        self.url = await self.nursery.start(self._serve)

    async def _serve(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.CancelScope() as self._cancel:
                keys = tuple(MODE_KEYS.values())
                async with open_test_server(self.data_dir, api_keys=keys) as url:
                    task_status.started(url)
                    await self._stop.wait()
        finally:
            self._done.set()

    async def stop(self, *, kill: bool = False) -> None:
        if kill:
            self._cancel.cancel()
        self._stop.set()
        await self._done.wait()

    async def restart(self, *, kill: bool) -> None:
        await self.stop(kill=kill)
        await self.start()


@asynccontextmanager
async def open_in_process_host(data_dir: Path) -> AsyncIterator[InProcessHost]:
    async with trio.open_nursery() as nursery:
        host = InProcessHost(data_dir=data_dir, nursery=nursery)
        await host.start()
        try:
            yield host
        finally:
            await host.stop()


# --- the interpreter -------------------------------------------------------------------------


@attrs.define
class _Point:
    """Where a conversation stands after a user turn: the chain's last response id, the
    history so far (what a resending client keeps), and the calls still owed an output."""

    previous: str | None = None
    history: list[Json] = attrs.field(factory=list)
    owed: list[p.ToolCall] = attrs.field(factory=list)


def completed_calls(items: Sequence[p.Item]) -> list[p.ToolCall]:
    return [
        typing.cast(p.ToolCall, i)
        for i in items
        if p.call_of(i) is not None and getattr(i, "status", None) == "completed"
    ]


def echoed(item: p.Item, *, bare: bool) -> Json:
    """An output item as a resending client puts it in the history: as received, or bare
    (no id, no `completed` status, an assistant message of one text part as a string)."""
    wire = dict(p.to_wire(item))
    if not bare:
        return wire
    if wire.get("type") != "local_shell_call_output":
        wire.pop("id", None)  # (a local shell output's id names its call)
    if wire.get("status") == "completed":  # (an incomplete item stays marked incomplete)
        del wire["status"]
    if wire.get("type") == "message":
        content = wire.get("content")
        if (
            isinstance(content, list)
            and len(content) == 1
            and content[0].get("type") == ("output_text")
        ):
            wire["content"] = content[0]["text"]
    return wire


class _Runner:
    """One mode's run of one script."""

    def __init__(
        self,
        script: AgentScript,
        mode: str,
        host: Host,
        http: httpx.AsyncClient,
        nursery: trio.Nursery,
    ) -> None:
        self.script = script
        self.nursery = nursery
        self.mode = mode
        self.host = host
        self.http = http
        self.out = Outcome(mode=mode)
        self.n = 0  # calls answered so far (numbers the answers)
        self.sent: set[str] = set()  # the ids of the calls answered
        self.deliveries = 0  # steps whose outputs were delivered (orders the deliveries)
        self.ws: WsClient | None = None
        self.point = _Point()
        self.chained = mode in ("ws_chain", "rollout", "inject", "http_chain", "restart")
        self.store = mode in ("http_chain", "restart") or (
            script.store and mode in ("ws_chain", "rollout", "inject")
        )
        self.restarted = False

    # -- answers ----
    def answers(self, calls: Sequence[p.ToolCall]) -> list[Json]:
        outputs = []
        for call in calls:
            self.sent.add(call.call_id)
            outputs.append(self.script.answer(call, self.n))
            self.n += 1
        return outputs

    def delivered(self, outputs: list[Json]) -> list[list[Json]]:
        """The outputs of one step in delivery order, in parts."""
        order, parts = self.script.delivery(self.deliveries, len(outputs))
        self.deliveries += 1
        if order != sorted(order):
            self.out.reordered += 1
        if len(parts) > 1:
            self.out.partial += 1
        ordered = [outputs[i] for i in order]
        chunks, start = [], 0
        for size in parts:
            chunks.append(ordered[start : start + size])
            start += size
        return chunks

    # -- the script ----
    async def run(self) -> Outcome:
        checkpoints = [_Point()]
        for turn in self.script.turns:
            if turn.fork is not None:
                self.point = attrs.evolve(checkpoints[turn.fork + 1])
                self.point.history = list(self.point.history)
            if turn.compact and not self.point.owed:
                await self.compact(turn)
            steps = await self.turn(turn)
            self.out.steps.append(steps)
            checkpoints.append(attrs.evolve(self.point, history=list(self.point.history)))
        if self.mode == "restart" and not self.restarted:
            await self.restart()
        await self.probe(self.script.turns[-1])
        return self.out

    async def turn(self, turn: Turn) -> int:
        """Run one user turn; returns the sampling steps that made calls."""
        new = [*self.answers(self.point.owed), turn.message()]
        self.point.owed = []
        if self.mode in ("rollout", "inject"):
            return await self.rollout_turn(turn, new)
        steps = 0
        for _ in range(MAX_STEPS):
            response = await self.create(turn.body(), new)
            self.out.add_response(response)
            await self.maybe_restart()
            calls = completed_calls(response.output)
            if response.status != "completed" or not calls:
                self.point.owed = calls
                return steps
            steps += 1
            self.out.calls.append(len(calls))
            self.out.suspensions += 1
            new = [item for part in self.delivered(self.answers(calls)) for item in part]
        raise AssertionError(f"{self.mode}: more than {MAX_STEPS} responses in one turn")

    def request(self, body: Json, new: list[Json]) -> Json:
        """The create body for `new` input: a chain sends only what is new after its previous
        response (all it has when there is none: a compaction window); a resending client
        sends the whole history."""
        point = self.point
        if not self.chained:
            return {**body, "input": [*point.history, *new], "store": False}
        if point.previous is None:
            return {**body, "input": [*point.history, *new], "store": self.store}
        return {**body, "input": new, "store": self.store, "previous_response_id": point.previous}

    def advance(self, new: list[Json], response: p.Response) -> None:
        point = self.point
        point.history += new
        point.history += [echoed(i, bare=self.script.bare_echo) for i in response.output]
        point.previous = response.id

    async def create(self, body: Json, new: list[Json]) -> p.Response:
        """One create of a chain or resending mode; the history and previous id follow."""
        body = self.request(body, new)
        if self.mode.startswith("http"):
            response = await self.http_create(body)
        else:
            response = await self.ws_create(body)
        self.advance(new, response)
        return response

    async def http_create(self, body: Json) -> p.Response:
        resp = await self.http.post(f"{self.host.url}/responses", json=body)
        assert resp.status_code == 200, (self.mode, resp.status_code, resp.text[:2000])
        return p.from_wire(resp.json(), p.Response)

    async def connection(self) -> WsClient:
        """The mode's WebSocket connection (opened on first use, held by a task of the
        run's nursery until `close_connection`)."""
        if self.ws is None:
            self.ws = await self.nursery.start(self._hold)
        return self.ws

    async def _hold(
        self, task_status: trio.TaskStatus[WsClient] = trio.TASK_STATUS_IGNORED
    ) -> None:
        headers = [(b"openai-beta", MULTI_AGENT_BETA.encode())] if self.mode == "inject" else []
        close, closed = trio.Event(), trio.Event()
        self._close, self._closed = close, closed
        try:
            async with open_ws(self.host.url, key=MODE_KEYS[self.mode], headers=headers) as ws:
                task_status.started(ws)
                await close.wait()
        finally:
            closed.set()

    async def close_connection(self) -> None:
        if self.ws is not None:
            self.ws = None
            self._close.set()
            await self._closed.wait()

    async def ws_create(self, body: Json) -> p.Response:
        ws = await self.connection()
        events = await ws.create(**body)
        return terminal_response(self.mode, events[-1])

    async def maybe_restart(self) -> None:
        if self.mode == "restart" and not self.restarted:
            if self.out.responses >= self.script.restart_after:
                await self.restart()

    async def restart(self) -> None:
        """Stop the server (after a terminal event: what it acknowledged is stored) and start
        a new one on the same data; the chain goes on over a new connection."""
        self.restarted = True
        await self.close_connection()
        await self.host.restart(kill=self.script.kill)
        self.out.restarts += 1

    # -- rollouts ----
    async def rollout_turn(self, turn: Turn, new: list[Json]) -> int:
        ws = await self.connection()
        body = self.request(turn.body(), new)
        if self.mode == "rollout":
            body["rollout"] = True
            await ws.send({"type": "response.create", **body})
            response, steps = await self.follow_rollout(ws)
        else:
            body["multi_agent"] = {"enabled": True}
            await ws.send({"type": "response.create", **body})
            response, steps = await self.follow_inject(ws, turn)
        self.out.add_response(response, attributed=self.mode == "inject")
        self.advance(new, response)
        # (a rollout's response lists the outputs appended to it only on the embedded handle)
        self.point.owed = [
            c for c in completed_calls(response.output) if c.call_id not in self.sent
        ]
        return steps

    async def follow_rollout(self, ws: WsClient) -> tuple[p.Response, int]:
        """Events to the end of a rollout; at each `response.done`, its pending calls'
        outputs appended in the drawn order and parts."""
        calls: dict[str, p.ToolCall] = {}
        steps = 0
        while True:
            events = await ws.until_terminal()
            for event in events:
                if isinstance(event, p.OutputItemDone) and p.call_of(event.item) is not None:
                    call = typing.cast(p.ToolCall, event.item)
                    calls[call.call_id] = call
            last = events[-1]
            if not isinstance(last, p.ResponseDone):
                return terminal_response(self.mode, last), steps
            steps += 1
            self.out.suspensions += 1
            pending = [calls[call_id] for call_id in last.pending_call_ids]
            self.out.calls.append(len(pending))
            for part in self.delivered(self.answers(pending)):
                await ws.send(
                    {"type": "response.append", "response_id": last.response.id, "input": part}
                )

    async def follow_inject(self, ws: WsClient, turn: Turn) -> tuple[p.Response, int]:
        """Events to the end of a multi-agent response. It waits silently at its calls: once a
        step's last call is done (the sim's `steps`/`parallel` rule says how many it makes),
        their outputs are injected in the drawn order and parts."""
        params = turn.params
        budget, parallel = params.get("steps", 1), params.get("parallel", 1)
        since_user = 0
        step_calls: list[p.ToolCall] = []
        steps = 0
        response_id = ""
        while True:
            event = await ws.recv()
            if isinstance(event, p.ResponseCreated):
                response_id = event.response.id
            if isinstance(event, p.OutputItemDone) and p.call_of(event.item) is not None:
                call = typing.cast(p.ToolCall, event.item)
                step_calls.append(call)
                expected = min(parallel, budget - since_user)
                if len(step_calls) == expected and call.status == "completed":
                    since_user += len(step_calls)
                    steps += 1
                    self.out.suspensions += 1
                    self.out.calls.append(len(step_calls))
                    outputs = self.answers(step_calls)
                    step_calls = []
                    for part in self.delivered(outputs):
                        await ws.send(
                            {"type": "response.inject", "response_id": response_id, "input": part}
                        )
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                return terminal_response(self.mode, event), steps
            if event.type == "error":
                raise AssertionError(f"{self.mode}: {ws.raw[-1]}")

    # -- compaction and the probe ----
    async def compact(self, turn: Turn) -> None:
        """Compact the conversation; the next turn starts a new chain from the window."""
        point = self.point
        body: Json = {k: v for k, v in turn.body().items() if k != "max_output_tokens"}
        if self.store and point.previous is not None:
            body["previous_response_id"] = point.previous
        else:
            body["input"] = point.history
        resp = await self.http.post(f"{self.host.url}/responses/compact", json=body)
        assert resp.status_code == 200, (self.mode, resp.status_code, resp.text[:2000])
        # The next input starts with the window, with no previous response.
        self.point = _Point(previous=None, history=list(resp.json()["output"]), owed=[])

    async def probe(self, last: Turn) -> None:
        """One more user turn, text only: its answer and input_tokens read the final context."""
        probe = Turn(
            text=PROBE, model=PROBE_MODEL, tools=last.tools, instructions=last.instructions
        )
        body = {**probe.body(), "tool_choice": "none"}
        new = [*self.answers(self.point.owed), probe.message()]
        if self.mode in ("rollout", "inject"):
            ws = await self.connection()
            body = self.request(body, new)
            if self.mode == "rollout":
                body["rollout"] = True
            else:
                body["multi_agent"] = {"enabled": True}
            events = await ws.create(**body)
            response = terminal_response(self.mode, events[-1])
        else:
            response = await self.create(body, new)
        assert response.status == "completed" and response.usage is not None, response
        texts = [
            part.text
            for item in response.output
            if isinstance(item, p.Message) and not isinstance(item.content, str)
            for part in item.content
            if isinstance(part, p.OutputText)
        ]
        self.out.context = (response.usage.input_tokens, "".join(texts))


def terminal_response(mode: str, event: Any) -> p.Response:
    if event.type == "error" or not hasattr(event, "response"):
        raise AssertionError(f"{mode}: the request failed: {p.to_wire(event)}")
    response = typing.cast(p.Response, event.response)
    if response.status == "failed":
        raise AssertionError(f"{mode}: the response failed: {response.error}")
    return response


async def run_mode(script: AgentScript, mode: str, host: Host) -> Outcome:
    """Run `script` in `mode` against `host`, with a deadline."""
    with trio.fail_after(REQUEST_TIMEOUT * 4):
        auth = {"Authorization": f"Bearer {MODE_KEYS[mode]}"}
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, headers=auth) as http:
            async with trio.open_nursery() as nursery:
                runner = _Runner(script, mode, host, http, nursery)
                try:
                    return await runner.run()
                finally:
                    await runner.close_connection()


async def run_script(
    script: AgentScript, host: Host, modes: Sequence[str] = MODES
) -> tuple[list[Outcome], dict[str, list[str]]]:
    """Run every mode (the first is the baseline) and compare them."""
    outcomes = [await run_mode(script, mode, host) for mode in modes]
    return outcomes, compare(outcomes)


def examples(*, default: int, ci: int, deep: int) -> settings:
    """Settings for an equivalence property test under the active Hypothesis profile
    (tests/conftest.py): `default` examples for a plain `pytest`, `ci` under
    `HYPOTHESIS_PROFILE=ci` (`.ci/run`), `deep` for local searching (`deep`, or its older
    name `thorough`). Only `deep` shrinks a failure: an example runs every mode against a
    server (about a second), and shrinking one takes many minutes; the unshrunk script is
    printed whole."""
    name = settings.get_current_profile_name()
    searching = name in ("deep", "thorough")
    count = {"ci": ci, "deep": deep, "thorough": deep}.get(name, default)
    # (No target phase: these tests target nothing, and the distributions stay the strategy's.)
    phases = tuple(Phase) if searching else tuple(ph for ph in Phase if ph is not Phase.shrink)
    return settings(
        max_examples=count,
        deadline=None,
        phases=phases,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# --- strategies ------------------------------------------------------------------------------

short_text = st.text(min_size=0, max_size=40)


@st.composite
def media_parts(draw: st.DrawFn) -> Json:
    """An input_image (by URL) or an input_file (a text file as a data: URL, or by URL)."""
    n = draw(st.integers(0, 99))
    kind = draw(st.sampled_from(["image", "text_file", "file_url"]))
    if kind == "image":
        detail = draw(st.sampled_from(["auto", "low", "high"]))
        return {
            "type": "input_image",
            "image_url": f"https://example.com/{n}.png",
            "detail": detail,
        }
    if kind == "text_file":
        body = draw(short_text)
        data = base64.b64encode(body.encode()).decode()
        return {
            "type": "input_file",
            "filename": f"notes-{n}.txt",
            "file_data": f"data:text/plain;base64,{data}",
        }
    return {"type": "input_file", "file_url": f"https://example.com/{n}.pdf"}


def sim_model(roll: random.Random, *, first: bool) -> str:
    steps = roll.choice([1, 2, 3, 4] if first else [0, 1, 2, 3])
    model = f"sim:steps={steps},parallel={roll.choice([1, 2, 3])},tokens={roll.randint(0, 24)}"
    reasoning = roll.choice([0, 0, 4, 12])
    return model + (f",reasoning={reasoning}" if reasoning else "")


@st.composite
def agent_scripts(draw: st.DrawFn, *, max_turns: int = 4) -> AgentScript:
    """Scripts that call a tool and suspend at least once (the first turn offers tools, has
    `steps >= 1` and no `max_output_tokens`), with several user turns, each of which may
    change the model, tools or instructions, cut off, fork from an earlier turn, or compact.

    Which features a script uses, and its sizes, are rolled by a `random.Random` seeded from
    a drawn integer, at the rates below (Hypothesis's own choices favour the simplest value
    heavily, derandomized most of all); texts, tools and schemas are drawn."""
    roll = random.Random(draw(st.integers(0, 2**32 - 1)))
    n_turns = min(max_turns, roll.choice([1, 2, 2, 3, 3, 3, 4, 4]))
    tools = draw(script_tools(roll.choice([1, 2, 3])))
    model = sim_model(roll, first=True)
    instructions = draw(st.none() | short_text.filter(bool))
    turns: list[Turn] = []
    for i in range(n_turns):
        if i:
            if roll.random() < 0.3:
                tools = draw(script_tools(roll.choice([1, 2, 3])))
            if roll.random() < 0.5:
                model = sim_model(roll, first=False)
            if roll.random() < 0.2:
                instructions = draw(st.none() | short_text.filter(bool))
        n_media = roll.choice([0, 0, 1, 2])
        turns.append(
            Turn(
                text=draw(short_text),
                media=tuple(draw(st.lists(media_parts(), min_size=n_media, max_size=n_media))),
                model=model,
                tools=tools,
                instructions=instructions,
                max_output_tokens=roll.randint(1, 40) if i and roll.random() < 0.3 else None,
                fork=roll.randint(0, i - 2) if i >= 2 and roll.random() < 0.3 else None,
                compact=i > 0 and roll.random() < 0.25,
            )
        )
    forks_or_compaction = any(t.fork is not None or t.compact for t in turns)
    return AgentScript(
        turns=tuple(turns),
        output_texts=tuple(draw(st.lists(short_text, min_size=1, max_size=3))),
        output_sizes=tuple(roll.choice(OUTPUT_SIZES) for _ in range(roll.randint(1, 3))),
        seed=roll.getrandbits(32),
        store=forks_or_compaction or roll.random() < 0.5,
        bare_echo=roll.random() < 0.5,
        restart_after=roll.randint(1, 6),
        kill=roll.random() < 0.5,
    )


def statistics(script: AgentScript, outcome: Outcome, record: Callable[[str], None]) -> None:
    """Distributions for `hypothesis.event` (shown by `--hypothesis-show-statistics`)."""

    def bucket(n: int, top: int) -> str:
        return f"{n}" if n < top else f"{top}+"

    record(f"user turns: {len(script.turns)}")
    record(f"responses (chain): {bucket(outcome.responses, 12)}")
    record(f"suspensions: {bucket(outcome.suspensions, 8)}")
    record(f"suspended at least once: {outcome.suspensions >= 1}")
    for steps in outcome.steps:
        record(f"steps with calls per turn: {steps}")
    for calls in outcome.calls:
        record(f"calls per step: {calls}")
    for size in sorted(set(script.output_sizes)):
        record(f"tool-output size: {size} chars")
    for kind in sorted({str(i["type"]) for i in outcome.items if i["type"].endswith("_call")}):
        record(f"call kind made: {kind}")
    features = {
        "cut off (max_output_tokens)": outcome.cut_off > 0,
        "fork": any(t.fork is not None for t in script.turns),
        "compaction": any(t.compact for t in script.turns),
        "media": any(t.media for t in script.turns),
        "reasoning": any("reasoning=" in t.model for t in script.turns),
        "model changed": len({t.model for t in script.turns}) > 1,
        "tools changed": any(t.tools != script.turns[0].tools for t in script.turns),
        "parallel calls": any(c > 1 for c in outcome.calls),
        "outputs delivered in parts": outcome.partial > 0,
        "outputs delivered out of order": outcome.reordered > 0,
    }
    for name, used in features.items():
        if used:
            record(f"feature: {name}")
