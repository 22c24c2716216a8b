"""Every way of running an agent rollout is the same rollout, over the wire.

Generated agent scripts (`tests.wire_scripts.agent_scripts`: several user turns, tool calls of
every kind a client runs, parallel calls, outputs up to tens of kilobytes delivered in parts
and out of order, `max_output_tokens` cut-offs, model/tool/instruction changes, forks, media,
reasoning items, compaction) run through the rollout extension, the multi-agent beta's
inject, the WebSocket `previous_response_id` chain, WebSocket full resend, HTTP stateless,
the HTTP chain with `store: true`, and a chain continued on a new connection after the server
restarted, as a real client sends them (JSON over real sockets). Every mode must produce the
same output items (modulo ids), the same usage and the same final rendered context (read by a
probe turn: `tests/wire_scripts.py` says how); every example must suspend at least once.

- In process: the server runs in this process on a loopback port (a fresh one, with its own
  data folder, per example), so many examples run.
- Over the wire: one `rollout serve` subprocess for the whole session (restarted on the same
  data folder, SIGTERM or SIGKILL, when a script runs the restart mode), fewer examples; a
  fixed script always restarts it, both ways.
- Deliberate bugs: a server process with one bug patched in (`tests/faulty_serve.py`) fails
  the comparison, for the comparison and the modes that bug must break; the same script
  passes against the real server.

The example counts follow the Hypothesis profile (`default`, `ci`, `deep`: tests/conftest.py);
`pytest --hypothesis-show-statistics` prints the distributions (turns, responses, steps, calls
per step, output sizes, suspensions, features used).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import event, given
from hypothesis import strategies as st

from tests.engine_harness import EVERY_KIND, LOOKUP_TOOL
from tests.wire_scripts import (
    MODE_KEYS,
    MODES,
    AgentScript,
    Host,
    Outcome,
    Turn,
    agent_scripts,
    describe,
    examples,
    open_in_process_host,
    run_script,
    statistics,
)
from tests.wire_server import ServerProcess

# Per example: seven modes, each a few dozen requests (and maybe a restart), on a loaded box.
DEADLINE = 300


@pytest.fixture(scope="session")
def wire_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`rollout serve` as a subprocess, once per test session (a key per mode)."""
    with ServerProcess(tmp_path_factory.mktemp("wire"), api_keys=MODE_KEYS.values()) as server:
        yield server


def check(
    script: AgentScript,
    outcomes: list[Outcome],
    found: dict[str, list[str]],
    record: Callable[[str], None],
) -> None:
    for outcome in outcomes:
        assert outcome.suspensions >= 1, f"{outcome.mode} never suspended: {script}"
    statistics(script, outcomes[0], record)
    assert not found, describe(outcomes, found)


async def run_checked(
    script: AgentScript,
    host: Host,
    modes: tuple[str, ...] = MODES,
    record: Callable[[str], None] = lambda _: None,
) -> list[Outcome]:
    """Run and compare every mode; every mode must have suspended. `record`: hypothesis's
    `event` in a property test."""
    with trio.fail_after(DEADLINE):
        outcomes, found = await run_script(script, host, modes)
    check(script, outcomes, found, record)
    return outcomes


# The schema hook (tests/conftest.py) would check every event of every example, which takes
# twice as long as running them: the fixed script's events are checked instead (below).
@pytest.mark.no_schema_hook
@examples(default=8, ci=60, deep=400)
@given(script=agent_scripts())
async def test_every_way_agrees_in_process(script: AgentScript) -> None:
    with tempfile.TemporaryDirectory(prefix="rollout-equiv-") as data:
        async with open_in_process_host(Path(data)) as host:
            await run_checked(script, host, record=event)


@examples(default=3, ci=12, deep=100)
@given(script=agent_scripts(), restart=st.sampled_from([False, True, False]))
async def test_every_way_agrees_over_the_wire(
    wire_server: ServerProcess, script: AgentScript, restart: bool
) -> None:
    """Against the session's `rollout serve` process; the restart mode (which restarts it)
    in some examples."""
    modes = MODES if restart else tuple(m for m in MODES if m != "restart")
    event(f"server restarted: {restart}")
    await run_checked(script, wire_server, modes, record=event)


# --- fixed scripts ----------------------------------------------------------------------------

# Two user turns: reasoning, parallel calls of two kinds, outputs of every size delivered out
# of order and in parts, a cut-off, and a restart after the second response.
FIXED = AgentScript(
    turns=(
        Turn(
            text="look these up",
            model="sim:steps=3,parallel=2,tokens=6,reasoning=5",
            tools=(LOOKUP_TOOL, EVERY_KIND["shell"]),
            instructions="You look things up.",
        ),
        Turn(
            text="and these",
            media=({"type": "input_image", "image_url": "https://example.com/a.png"},),
            model="sim:steps=2,parallel=3,tokens=4,reasoning=3",
            tools=(LOOKUP_TOOL, EVERY_KIND["custom-regex"]),
        ),
        Turn(
            text="once more",
            model="sim:steps=1,tokens=4",
            tools=(LOOKUP_TOOL,),
            max_output_tokens=3,
        ),
    ),
    output_texts=("found", "nothing here"),
    output_sizes=(40, 12_000, 0),
    seed=7,
    store=False,
    bare_echo=True,
    restart_after=2,
)


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
async def test_chain_continues_after_a_restart_over_the_wire(
    wire_server: ServerProcess, kill: bool
) -> None:
    """The restart genuinely happens: a new process (a new pid and port) continues the chain
    from the store, after SIGKILL as after SIGTERM."""
    starts, url = wire_server.starts, wire_server.url
    await run_checked(attrs.evolve(FIXED, kill=kill), wire_server)
    assert wire_server.starts == starts + 1 and wire_server.url != url


async def test_a_chain_from_a_window_ending_in_a_cut_off_call(tmp_path: Path) -> None:
    """Compaction after a response cut off inside a tool call: the call waits for no output
    in the window's chain either (found by the property test: the chain from the window
    was refused with "No tool output found")."""
    script = AgentScript(
        turns=(
            Turn(text="go", model="sim:steps=1,tokens=2", tools=(LOOKUP_TOOL,)),
            Turn(
                text="more", model="sim:steps=1,tokens=2", tools=(LOOKUP_TOOL,), max_output_tokens=1
            ),
            Turn(text="then", model="sim:steps=1,tokens=2", tools=(LOOKUP_TOOL,), compact=True),
        ),
        output_texts=("ok",),
        output_sizes=(0,),
        seed=0,
        store=True,
        bare_echo=False,
    )
    async with open_in_process_host(tmp_path) as host:
        outcomes = await run_checked(script, host)
    assert outcomes[0].cut_off == 1


# --- deliberate bugs -----------------------------------------------------------------------------

# fault -> (the comparisons that must fail, the modes that must differ in each), and whether
# only those comparisons fail.
FAULTS: dict[str, tuple[dict[str, set[str]], bool]] = {
    # The chain modes (the baseline among them) lose the output: every other mode differs.
    "chain_drops_output": (
        {"context": {"rollout", "inject", "ws_resend", "http_stateless"}},
        False,
    ),
    # Only the two rollout doors append.
    "rollout_renders_append_twice": ({"context": {"rollout", "inject"}}, False),
    # Only the store-backed chains hydrate: HTTP at every create, the WebSocket after a restart.
    "hydration_drops_reasoning": ({"context": {"http_chain", "restart"}}, False),
    # Only a response of several steps aggregates usage; the items and context stay equal.
    "usage_off_by_one": ({"usage": {"rollout", "inject"}}, True),
}


@pytest.mark.no_schema_hook
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_deliberate_bug_fails_the_comparison(tmp_path: Path, fault: str) -> None:
    expected, only = FAULTS[fault]
    server = ServerProcess(tmp_path / "data", api_keys=MODE_KEYS.values(), fault=fault)
    await trio.to_thread.run_sync(server.start)
    try:
        with trio.fail_after(DEADLINE):
            outcomes, found = await run_script(FIXED, server)
    finally:
        await trio.to_thread.run_sync(server.__exit__, None, None, None)
    report = describe(outcomes, found)
    for comparison, modes in expected.items():
        assert comparison in found, report
        assert set(found[comparison]) == modes, report
    if only:
        assert set(found) == set(expected), report


# The rest of the features: a fork, compaction, the other built-in tools, a lark grammar.
MORE = attrs.evolve(
    FIXED,
    turns=(
        *FIXED.turns,
        Turn(
            text="from the second turn",
            model="sim:steps=2,parallel=2,tokens=3,reasoning=2",
            tools=tuple(EVERY_KIND[k] for k in ("computer", "apply_patch", "custom-lark")),
            fork=1,
        ),
        Turn(
            text="compacted",
            model="sim:steps=1,parallel=2,tokens=3",
            tools=(EVERY_KIND["local_shell"], LOOKUP_TOOL),
            compact=True,
        ),
    ),
    store=True,
    bare_echo=False,
    restart_after=9,
)


@pytest.mark.parametrize("script", [FIXED, MORE], ids=["fixed", "more"])
async def test_fixed_scripts_agree_in_process(tmp_path: Path, script: AgentScript) -> None:
    """In process, where the schema hook checks every event and response the modes were sent
    (reasoning items, suspensions, injects, compaction) against the schema and the SDK."""
    async with open_in_process_host(tmp_path) as host:
        await run_checked(script, host)


async def test_the_fixed_script_agrees_on_the_real_server(wire_server: ServerProcess) -> None:
    """The deliberate bugs' script passes without them (so each failure is its bug's)."""
    await run_checked(FIXED, wire_server)
