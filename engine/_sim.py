"""The simulated model: deterministic, paced on trio's clock, driven by its model id.

Long because the simulated model stands in for every model behaviour the tests need: pacing,
tool calls of every kind, grammars and JSON schemas, reasoning, and its parameters' checks.

Its output is a deterministic function of the whole rendered context (the context digest the
engine maintains incrementally), so any difference in context between two ways of running the
same rollout shows up as different output. Its behaviour is chosen by the model string, so an
unmodified client can drive it:

    sim[:key=value,...]

| key         | default   | meaning                                                               |
|-------------|-----------|-----------------------------------------------------------------------|
| steps       | 1         | while tools are declared and fewer than `steps` function calls were    |
|             |           | made since the last user message, call tools; otherwise answer text   |
| parallel    | 1         | function calls per turn (1 when `parallel_tool_calls` is false)        |
| tokens      | 32        | length of a text answer, in tokens                                    |
| tps         | unlimited | sampled tokens per second                                             |
| ttft_ms     | 0         | delay before the first token                                          |
| interval_ms | 5         | the engine step: tokens go out at steps one interval apart on one     |
|             |           | clock shared by every response, as a batched inference engine's do;   |
|             |           | a delta carries every token sampled by its step (0: no steps)         |
| reasoning   | 0         | a `reasoning` output item of this many tokens before each turn's       |
|             |           | answer or calls (when `max_output_tokens` leaves room for it and more) |

A text answer to a user turn with images or files starts by acknowledging them
("I see 1 image and 2 files.").
With `text.format` of type `json_schema` (or `json_object`), a text answer is a JSON document
valid for the schema (structured outputs), whatever `tokens` says.
It honours `tool_choice` like a real model (`none`: text; `required`: always call a tool;
a named tool or a forced built-in type: always call that tool; `allowed_tools`: only those;
`auto`: the `steps` rule), `parallel_tool_calls: false`, and `max_output_tokens` (the turn
stops there and the response ends `incomplete`).

With `reasoning=N`, each turn starts with a finished `reasoning` item (not streamed): a summary
of N words (`summary_text`) and `encrypted_content` (opaque to clients: base64 of the summary,
as the API returns it for `include: ["reasoning.encrypted_content"]`). Its N tokens count as
output tokens and against `max_output_tokens`; it renders into the context (`_render.py`), so
a client that echoes it back, or a chain that keeps it, changes what the model sees next.

It calls every kind of tool a client runs:
- function tools: arguments generated from the tool's JSON schema, valid for the common
  keywords (type, properties, required, enum, const, items, min/max, lengths, anyOf/oneOf/allOf
  taking the first branch);
- custom tools: a few words (`text` format), or a string the tool's lark or regex grammar
  accepts (`engine._grammar`; a grammar it cannot generate from leaves the tool uncalled);
- `shell` (`{"commands": ["echo ..."]}`), `local_shell` (`echo` with arguments),
  `apply_patch` (creates `notes/<word>.txt`) and `computer` (a screenshot or a click);
- hosted tools, when the engine offers them (an executor is configured): `{"query": ...}`.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import random
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import trio
from rollout.protocol import CustomTool, FunctionTool, NamespaceTool, RemoteProtocolError

from ._errors import BackendError
from ._grammar import GrammarError, check_grammar, grammar_instance
from ._interfaces import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Finish,
    ReasoningDone,
    SampleEvent,
    SampleRequest,
    TextDelta,
    TextEnd,
    TextStart,
)
from ._tools import CallTarget, resolve_choice

__all__ = ["SIM_PARAMS", "SimBackend", "SimParams", "schema_instance"]

# Single-token English words (each is one o200k token with its leading space).
_WORDS = (
    " the of and to in is that for it as was with be by on not he this are or his from at which"
    " but have an they you were her she there been one all we their has would when if so no what"
    " up out who them some into more time could about than only other new over also after can"
    " first made well like way years work then most should through may such where back any"
    " these great much before good people use day man long must world life here between both"
    " under never same another know while last might us great old year off come since against"
    " go came right used take three states himself few house during without place again home"
    " small found thought went say part once general high upon school every don does got united"
    " left number course war until always away something fact though water less public put think"
    " almost hand enough far took head yet government system better set told nothing night end"
    " why called didn eyes find going look asked later knew point next city business give group"
    " toward young let room side social given present several order national possible rather"
    " second face per among form important often things looked early white case john become large"
    " big need four within felt along children saw best church ever least power development light"
).split(" ")[1:]
_VOCAB = tuple(" " + w for w in _WORDS)

SIM_PARAMS = ("steps", "parallel", "tokens", "tps", "ttft_ms", "interval_ms", "reasoning")
# Bounds on parameters a peer can choose through the model string.
MAX_SIM_TOKENS = 1_000_000
MAX_SIM_STEPS = 100_000
MAX_SIM_PARALLEL = 128
MAX_SIM_REASONING = 100_000  # tokens of one reasoning item
MAX_SIM_TPS = 10_000_000  # far beyond any model; past it, "unlimited" (tps=0) says it better
MAX_SIM_DELAY_MS = 3_600_000  # an hour: longer delays only hold a connection for nothing
MIN_SIM_STEP = 1e-6  # seconds: a shorter `interval_ms` (down to denormals) means no steps


class SimParams:
    __slots__ = ("interval", "parallel", "reasoning", "steps", "tokens", "tps", "ttft")

    def __init__(self, params: Mapping[str, str]) -> None:
        self.steps = _int(params, "steps", 1, 0, MAX_SIM_STEPS)
        self.parallel = _int(params, "parallel", 1, 1, MAX_SIM_PARALLEL)
        self.tokens = _int(params, "tokens", 32, 0, MAX_SIM_TOKENS)
        tps = _float(params, "tps", 0.0, MAX_SIM_TPS)
        self.tps = tps if tps > 0 else math.inf
        self.ttft = _float(params, "ttft_ms", 0.0, MAX_SIM_DELAY_MS) / 1000
        self.interval = _float(params, "interval_ms", 5.0, MAX_SIM_DELAY_MS) / 1000
        self.reasoning = _int(params, "reasoning", 0, 0, MAX_SIM_REASONING)


def _bad(key: str, value: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(
        f"Invalid sim model parameter {key}={value!r}: {why}.", code="invalid_value", param="model"
    )


def _int(params: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(key, raw, "expected an integer") from None
    if not lo <= value <= hi:
        raise _bad(key, raw, f"expected {lo}..{hi}")
    return value


def _float(params: Mapping[str, str], key: str, default: float, hi: float) -> float:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(key, raw, "expected a number") from None
    if not math.isfinite(value) or value < 0:
        raise _bad(key, raw, "expected a non-negative number")
    if value > hi:
        raise _bad(key, raw, f"expected at most {hi:g}")
    return value


class SimBackend:
    """The `sim` family. Stateless: everything comes from the SampleRequest."""

    def check_params(self, params: Mapping[str, str]) -> None:
        unknown = sorted(set(params) - set(SIM_PARAMS))
        if unknown:
            known = ", ".join(SIM_PARAMS)
            raise _bad(unknown[0], params[unknown[0]], f"unknown; known are {known}")
        SimParams(params)

    async def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        p = SimParams(request.params)
        rng = random.Random(request.context_digest)
        budget = (
            request.max_output_tokens if request.max_output_tokens is not None else MAX_SIM_TOKENS
        )
        start = trio.current_time()
        clock = _Pacer(start + p.ttft, p.tps, p.interval)
        if p.ttft:
            await clock.until(clock.on_step(start + p.ttft))
        if p.reasoning and p.reasoning < budget:
            summary = _words(rng, p.reasoning)
            budget -= p.reasoning
            await clock.wait(p.reasoning)
            clock.advance(p.reasoning)  # the answer's tokens come after the reasoning's
            sealed = base64.b64encode(summary.encode()).decode()
            yield ReasoningDone(summary, encrypted_content=sealed, n_tokens=p.reasoning)

        if _uses_grammars(request.tools):
            # Compiling and deriving from a client's grammar is bounded (engine._grammar) but
            # can take a noticeable fraction of a second: off the event loop.
            calls, payloads = await trio.to_thread.run_sync(self._plan, request, p, rng)
        else:
            calls, payloads = self._plan(request, p, rng)
        if not calls:
            fmt = request.text_format or {}
            if fmt.get("type") in ("json_schema", "json_object"):
                # Structured output: a JSON instance of the schema, streamed in 4-char pieces.
                document = _written(
                    "a JSON document for the text format",
                    lambda: json.dumps(
                        schema_instance(fmt.get("schema") or {"type": "object"}, rng),
                        ensure_ascii=False,
                    ),
                )
                pieces = [document[i : i + 4] for i in range(0, len(document), 4)] or [""]
            else:
                pieces = _acknowledgement(*request.media_since_user) + rng.choices(
                    _VOCAB, k=p.tokens
                )
                if pieces:
                    pieces[0] = pieces[0].lstrip()
            n = min(len(pieces), budget)
            yield TextStart()
            emitted = 0
            while emitted < n:
                size = 1 if emitted == 0 else max(1, min(n - emitted, clock.per_interval(p)))
                await clock.wait(emitted + size)
                if emitted:  # woken late: every token due by now goes in this delta
                    size = max(size, min(n, clock.due()) - emitted)
                text = "".join(pieces[emitted : emitted + size])
                emitted += size
                yield TextDelta(text, size)
            if n < len(pieces):
                # Cut off by max_output_tokens: the message is left open (like a function call
                # cut off below) and the engine closes it `incomplete`.
                yield Finish("max_output_tokens")
                return
            yield TextEnd()
            yield Finish("stop")
            return

        used = 0
        for call, payload in zip(calls, payloads, strict=True):
            yield CallStart(call.name, call.namespace, call.kind)
            n_pieces = max(1, -(-len(payload) // 4))  # a token is 4 characters of arguments
            i = 0
            while i < n_pieces:
                size = 1 if used == 0 else max(1, clock.per_interval(p))
                take = min(size, n_pieces - i)
                if used + take > budget:
                    take = max(0, int(budget - used))
                    if take:
                        used += take
                        await clock.wait(used)
                        yield ArgsDelta(payload[4 * i : 4 * (i + take)], take)
                    yield Finish("max_output_tokens")
                    return
                await clock.wait(used + take)
                if used:  # woken late: every token due by now goes in this delta
                    take = max(take, min(n_pieces - i, int(budget - used), clock.due() - used))
                used += take
                yield ArgsDelta(payload[4 * i : 4 * (i + take)], take)
                i += take
            yield CallEnd()
        yield Finish("tool_calls")

    @classmethod
    def _plan(
        cls, request: SampleRequest, p: SimParams, rng: random.Random
    ) -> tuple[list[CallTarget], list[str]]:
        """The calls of this turn and their payloads (in the order they consume `rng`)."""
        calls = cls._plan_calls(request, p, rng)
        payloads = [
            _written(f"a call of {call.qualified}", functools.partial(_payload, call, rng))
            for call in calls
        ]
        return calls, payloads

    @staticmethod
    def _plan_calls(request: SampleRequest, p: SimParams, rng: random.Random) -> list[CallTarget]:
        choice = resolve_choice(request.tool_choice, request.tools)
        candidates = [c for c in choice.tools if _callable(c)]
        if not candidates or choice.mode == "none":
            return []
        per_turn = p.parallel if request.parallel_tool_calls else 1
        if isinstance(request.tool_choice, str) or choice.mode != "required":
            if choice.mode == "auto":
                remaining = p.steps - request.calls_since_user
                if remaining <= 0:
                    return []
                per_turn = min(per_turn, remaining)
            return [rng.choice(candidates) for _ in range(per_turn)]
        if len(candidates) == 1:  # a named tool or a forced built-in type
            return candidates * per_turn
        return [rng.choice(candidates) for _ in range(per_turn)]


def _uses_grammars(tools: Any) -> bool:
    """Does any offered custom tool (also inside a namespace) carry a grammar?"""
    for tool in tools:
        for member in tool.tools if isinstance(tool, NamespaceTool) else [tool]:
            if (
                isinstance(member, CustomTool)
                and member.format is not None
                and member.format.type == "grammar"
            ):
                return True
    return False


def _written(what: str, write: Callable[[], str]) -> str:
    """What `write` produces, or a `BackendError` (the response fails, never the server) when
    the schema or grammar asks for too much or is malformed beyond what validation catches."""
    try:
        return str(write())
    except InstanceTooLarge:
        raise BackendError(
            f"The simulated model cannot write {what}: the schema asks for more than "
            f"{MAX_INSTANCE_VALUES} values or {MAX_INSTANCE_CHARS} characters."
        ) from None
    except (GrammarError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise BackendError(f"The simulated model cannot write {what}: {exc}.") from None


def _callable(call: CallTarget) -> bool:
    """Can sim make this call? Any offered tool (client-run, or hosted with an executor), but
    a custom tool's grammar must be one it can generate from."""
    tool = call.tool
    if isinstance(tool, CustomTool) and tool.format is not None and tool.format.type == "grammar":
        try:
            check_grammar(tool.format.syntax or "lark", tool.format.definition or "")
        except GrammarError:
            return False
    return True


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_VOCAB) for _ in range(n)).strip()


def _payload(call: CallTarget, rng: random.Random) -> str:
    """The arguments, input or payload of one call (see the module docstring)."""
    tool = call.tool
    if isinstance(tool, FunctionTool):
        return json.dumps(
            schema_instance(tool.parameters or {"type": "object"}, rng), ensure_ascii=False
        )
    if isinstance(tool, CustomTool):
        fmt = tool.format
        if fmt is not None and fmt.type == "grammar":
            seed = rng.getrandbits(64)
            return str(grammar_instance(fmt.syntax or "lark", fmt.definition or "", seed))
        return _words(rng, 6)
    word = rng.choice(_WORDS[1:])
    if call.kind == "shell":
        return json.dumps({"commands": [f"echo {_words(rng, 3)}"]})
    if call.kind == "local_shell":
        return json.dumps({"type": "exec", "command": ["echo", *_words(rng, 3).split()]})
    if call.kind == "apply_patch":
        diff = f"+{_words(rng, 6)}\n"
        return json.dumps({"type": "create_file", "path": f"notes/{word}.txt", "diff": diff})
    if call.kind != "computer":  # a hosted tool: a query
        return json.dumps({"query": _words(rng, 4)})
    if rng.random() < 0.5:
        return json.dumps({"type": "screenshot"})
    x, y = rng.randint(0, 1023), rng.randint(0, 767)
    return json.dumps({"type": "click", "button": "left", "x": x, "y": y})


def _acknowledgement(images: int, files: int) -> list[str]:
    """Words acknowledging the images and files of the current user turn, so a client can see
    they reached the model (the engine counts them incrementally, per item)."""
    if not images and not files:
        return []
    return [f" I see {images} image{'s' * (images != 1)} and {files} file{'s' * (files != 1)}."]


class _StepTimers:
    """One timer per engine step for all the responses of a run that wait for it: the first
    to wait sleeps until the step and wakes the others with an event. A trio sleep is a
    deadline on a cancel scope, and its expiry a cancellation delivered to the sleeper; one
    per step instead of one per response per step is most of the simulated model's cost with
    many responses streaming (`bench/README.md`). A sleeper cancelled before the step wakes
    the others early, and one of them sleeps on in its place."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due: dict[float, trio.Event] = {}  # each step being waited for: its wake-up

    async def until(self, t: float) -> None:
        if trio.current_time() >= t:
            await trio.lowlevel.checkpoint()
            return
        while trio.current_time() < t:
            woken = self._due.get(t)
            if woken is not None:
                await woken.wait()
                continue
            woken = self._due[t] = trio.Event()
            try:
                await trio.sleep_until(t)
            finally:
                del self._due[t]
                woken.set()


_STEP_TIMERS: trio.lowlevel.RunVar[_StepTimers] = trio.lowlevel.RunVar("rollout_sim_steps")


def _step_timers() -> _StepTimers:
    """The run's step timers (a run's own: steps are on its clock)."""
    try:
        return _STEP_TIMERS.get()
    except LookupError:
        timers = _StepTimers()
        _STEP_TIMERS.set(timers)
        return timers


class _Pacer:
    """Tokens become available at `first + n / tps` on trio's clock, and go out at the engine
    step that follows: like a batched inference engine, the simulated model advances every
    sequence it serves at the same steps, one every `interval` seconds on one clock, so the
    deltas of concurrent responses go out together (and a server wakes once per step for all
    of them, not once per response)."""

    __slots__ = ("first", "step", "tps")

    def __init__(self, first: float, tps: float, step: float) -> None:
        self.first = first
        self.tps = tps
        # A step shorter than `MIN_SIM_STEP` is no step (and `t / step` cannot overflow).
        self.step = step if step >= MIN_SIM_STEP else 0.0

    def per_interval(self, p: SimParams) -> int:
        if math.isinf(self.tps):
            return 1_000_000
        return max(1, int(self.tps * p.interval))

    def advance(self, n_tokens: int) -> None:
        """Count from after `n_tokens` already sampled."""
        if not math.isinf(self.tps):
            self.first += n_tokens / self.tps

    def on_step(self, t: float) -> float:
        """The engine step nearest to time `t` (so the steps add no delay on average)."""
        if self.step <= 0:
            return t
        return round(t / self.step) * self.step

    async def wait(self, n_tokens: int) -> None:
        if not math.isinf(self.tps):
            await self.until(self.on_step(self.first + n_tokens / self.tps))

    async def until(self, t: float) -> None:
        """Sleep until `t`: on a step, with the other responses waiting for it."""
        if self.step <= 0:
            await trio.sleep_until(t)
        else:
            await _step_timers().until(t)

    def due(self) -> int:
        """Tokens sampled by now (0 when unpaced: the caller's own size stands)."""
        if math.isinf(self.tps):
            return 0
        return int((trio.current_time() - self.first) * self.tps + 1e-9)


# --- JSON schema instances -------------------------------------------------------------------

_MAX_DEPTH = 6
# Work one instance may take: JSON values produced and characters of text. Schemas reach here
# bounded (engine._schemas), but their bounds still multiply (an array of arrays of long
# strings); past these the model fails the response instead of working on.
MAX_INSTANCE_VALUES = 10_000
MAX_INSTANCE_CHARS = 1_000_000


class InstanceTooLarge(Exception):
    """The schema asks for more than `MAX_INSTANCE_VALUES` values or `MAX_INSTANCE_CHARS`."""


class _Budget:
    __slots__ = ("chars", "values")

    def __init__(self) -> None:
        self.values = MAX_INSTANCE_VALUES
        self.chars = MAX_INSTANCE_CHARS

    def take(self, values: int = 1, chars: int = 0) -> None:
        self.values -= values
        self.chars -= chars
        if self.values < 0 or self.chars < 0:
            raise InstanceTooLarge


def _size(schema: dict[str, Any], key: str, default: int) -> int:
    """A size keyword as a small non-negative int (whatever the client wrote)."""
    value = schema.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return default
    return max(0, min(int(value), MAX_INSTANCE_CHARS))


def schema_instance(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value that validates against `schema` for the common keywords (best effort beyond).
    Raises `InstanceTooLarge` past the instance budget; a malformed schema gives a best-effort
    value, never an exception."""
    return _instance(schema, rng, depth, _Budget())


def _instance(schema: Any, rng: random.Random, depth: int, budget: _Budget) -> Any:
    budget.take()
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            return _instance(branches[0], rng, depth + 1, budget)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        out: dict[str, Any] = {}
        props = schema.get("properties")
        if depth >= _MAX_DEPTH or not isinstance(props, dict):
            return out
        listed = schema.get("required")
        required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
        for name, sub in props.items():
            if name in required or rng.random() < 0.5:
                budget.take(chars=len(name))
                out[name] = _instance(sub, rng, depth + 1, budget)
        return out
    if kind == "array":
        lo = _size(schema, "minItems", 0)
        hi = _size(schema, "maxItems", max(lo, 3))
        n = lo if depth >= _MAX_DEPTH else rng.randint(lo, max(lo, min(hi, lo + 3)))
        budget.take(values=n)  # before building: a huge minItems fails at once
        return [_instance(schema.get("items", {}), rng, depth + 1, budget) for _ in range(n)]
    if kind == "integer":
        ilo, ihi = _bounds(schema, integer=True)
        return rng.randint(int(ilo), int(ihi))
    if kind == "number":
        flo, fhi = _bounds(schema, integer=False)
        value = round(rng.uniform(flo, fhi), 3) if flo < fhi else flo
        return value if flo <= value <= fhi else (flo + fhi) / 2  # rounded out of a tiny range
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    lo_len = _size(schema, "minLength", 1)
    hi_len = _size(schema, "maxLength", max(lo_len, 24))
    budget.take(chars=lo_len)
    text = "".join(rng.choices(_VOCAB, k=4)).strip()
    pieces, length = [text], len(text)
    while length < lo_len:  # words, drawn in batches, until long enough (linear in lo_len)
        more = "".join(rng.choices(_VOCAB, k=(lo_len - length) // 4 + 1))
        pieces.append(more)
        length += len(more)
    return "".join(pieces)[:hi_len]


def _bounds(schema: dict[str, Any], *, integer: bool) -> tuple[float, float]:
    step = 1 if integer else 1e-3
    lo, hi = -math.inf, math.inf
    if "minimum" in schema:
        lo = float(schema["minimum"])
    if "exclusiveMinimum" in schema:
        lo = max(lo, float(schema["exclusiveMinimum"]) + step)
    if "maximum" in schema:
        hi = float(schema["maximum"])
    if "exclusiveMaximum" in schema:
        hi = min(hi, float(schema["exclusiveMaximum"]) - step)
    # A side left open spans 100 from the other (0..100 when both are): an upper bound below
    # zero alone must not give the default lower bound 0.
    if math.isinf(lo):
        lo = 0.0 if hi >= 0 else hi - 100
    if math.isinf(hi):
        hi = lo + 100
    if integer:
        lo, hi = float(math.ceil(lo)), float(math.floor(hi))
    return lo, max(lo, hi)
