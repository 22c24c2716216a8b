"""`rollout bench --scenario gateway` (`bench/_gateway.py`): rollout in front of a fake
chat-completions model that stamps each request's arrival.

- A small run end to end: every client's turns reach the model, the overhead is positive and
  below the turn's time, the server's stages are read, and every client sent the model the
  same bytes (the same conversation), which the results say.
- The goals judge medians as the issue states them, each shown failing on results that break
  it, and "not measured" without the points.
- The fake upstream answers the same conversation the same way (call ids numbered).
- A gateway the benchmark did not start (`--url`, `--upstream-port`, `--model`): the fake model
  server on a fixed port, the stage table only from rollout's metrics, a mode the server fails
  reported as refused or failed (the other modes go on), and a client whose history the server
  dropped shown as another conversation, not as a fast number; the same messages written in
  other bytes are told apart from that.
"""

from __future__ import annotations

import argparse
import copy
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from rollout.bench._cli import add_parser, gateway_plan
from rollout.bench._cli import run as bench_run
from rollout.bench._errors import BenchError, ServerError
from rollout.bench._gateway import (
    GOALS,
    MODES,
    Arrival,
    FakeUpstream,
    GatewayPlan,
    _Conversation,
    body_digest,
    build_results,
    content_digest,
    judge,
    open_upstream,
    render_gateway_summary,
    run_conversations,
    run_gateway,
    same_bodies,
    validate_gateway,
)
from rollout.bench._server import Endpoint, free_port, open_local_server

DEADLINE = 120


async def test_a_small_run_measures_every_client(tmp_path: Path) -> None:
    plan = GatewayPlan(sizes=(500, 12_000), repetitions=1, turns=2, warm=1)
    with trio.fail_after(DEADLINE):
        results = await run_gateway(plan, tmp_path, lambda _: None)
    validate_gateway(results)
    assert {(p["mode"], p["size"]) for p in results["points"]} == {
        (m, s) for m in MODES for s in plan.sizes
    }
    for run in results["runs"]:
        assert len(run["turns"]) == plan.turns
        for turn in run["turns"]:
            assert 0 < turn["overhead"] < turn["turn_time"]
            assert turn["upstream_bytes"] > 0
        assert "decode" in run["stages_s"] and "upstream_send" in run["stages_s"]
    assert results["same_upstream_bodies"] == {
        "compared": 2 * len(MODES),
        "differ": [],
        "other_bytes": [],
    }
    assert results["meta"]["server"]["started"] and results["meta"]["server"]["stage_metrics"]
    assert results["refused"] == {} and {p["bodies"] for p in results["points"]} == {"same"}
    assert [g["name"] for g in results["goals"]] == [g.name for g in GOALS]
    assert all(g["verdict"] in ("MET", "MISSED") for g in results["goals"])
    summary = render_gateway_summary(results)
    assert "| ws-chain |" in summary and "upstream_send" in summary


def results_with(overheads: dict[tuple[str, int], float]) -> dict[str, Any]:
    points = [{"mode": m, "size": s, "overhead_ms": v} for (m, s), v in overheads.items()]
    return {"points": points}


GOOD = {
    ("ws-chain", 1000): 1.0,
    ("ws-chain", 100000): 1.2,
    ("http-stateless", 1000): 1.3,
    ("http-stateless", 100000): 1.6,
}


def verdicts(overheads: dict[tuple[str, int], float]) -> dict[str, str]:
    return {g["name"]: g["verdict"] for g in judge(results_with(overheads))}


def test_the_goals_are_met_at_their_limits() -> None:
    assert set(verdicts(GOOD).values()) == {"MET"}
    ratios = {g["name"]: g["ratio"] for g in judge(results_with(GOOD))}
    assert ratios == {"ws-chain-flat": 1.2, "stateless-flat": 1.231, "stateless-vs-chain": 1.333}


@pytest.mark.parametrize(
    ("point", "value", "missed"),
    [
        (("ws-chain", 100000), 1.25, {"ws-chain-flat"}),
        (("http-stateless", 100000), 1.7, {"stateless-flat", "stateless-vs-chain"}),
        (("ws-chain", 100000), 1.1, {"stateless-vs-chain"}),
        (("ws-chain", 1000), 0.9, {"ws-chain-flat"}),
        (("http-stateless", 1000), 1.2, {"stateless-flat"}),
    ],
)
def test_each_goal_fails_when_its_ratio_passes_the_limit(
    point: tuple[str, int], value: float, missed: set[str]
) -> None:
    broken = copy.deepcopy(GOOD)
    broken[point] = value
    assert {name for name, v in verdicts(broken).items() if v == "MISSED"} == missed


def test_a_goal_without_its_points_is_not_measured() -> None:
    partial = {k: v for k, v in GOOD.items() if k[0] == "ws-chain"}
    assert verdicts(partial) == {
        "ws-chain-flat": "MET",
        "stateless-flat": "not measured",
        "stateless-vs-chain": "not measured",
    }


def test_bodies_differing_only_in_relayed_call_names_have_one_digest() -> None:
    a = b'{"messages":[{"tool_calls":[{"id":"call_0123456789abcdef01234567"}]},' + (
        b'{"tool_call_id":"call_0123456789abcdef01234567"}]}'
    )
    b = a.replace(b"0123456789abcdef01234567", b"fedcba9876543210fedcba98")
    assert body_digest(a) == body_digest(b)
    assert body_digest(a) != body_digest(a.replace(b'"tool_call_id"', b'"tool_call"'))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "gateway", "--scenario", "alpha-demo"], "runs alone"),
        (["--scenario", "gateway", "--url", "http://127.0.0.1:1/v1"], "needs --upstream-port"),
        (
            [
                "--scenario",
                "gateway",
                "--upstream-port",
                "18300",
                "--url",
                "a=http://127.0.0.1:1/v1",
                "--url",
                "b=http://127.0.0.1:2/v1",
            ],
            "one --url",
        ),
        (
            [
                "--scenario",
                "gateway",
                "--upstream-port",
                "18300",
                "--url",
                "http://127.0.0.1:1/v1",
                "--local",
                "gateway=--no-render-cache",
            ],
            "with --url it starts none",
        ),
        (["--scenario", "gateway", "--api-key", "sk-x"], "for the server given by --url"),
        (["--scenario", "gateway", "--upstream-port", "70000"], "takes a port"),
        (
            ["--scenario", "gateway", "--upstream-port", "18300", "--url", "ftp://host/v1"],
            "base URL",
        ),
        (["--scenario", "gateway", "--local", "other=--workers 2"], "takes gateway=ARGS"),
    ],
)
def test_command_line_refusals(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv, "--out", str(tmp_path / "out")])
    assert bench_run(args) == 2  # a usage error: one line
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--scenario", "gateway", *argv])


def test_the_command_line_names_a_server_it_did_not_start(tmp_path: Path) -> None:
    plan, key = gateway_plan(
        parsed(
            "--url",
            "ogx=http://127.0.0.1:18301/v1",
            "--upstream-port",
            "18300",
            "--model",
            "served-name",
            "--api-key",
            "sk-peer",
            "--repetitions",
            "2",
            "--out",
            str(tmp_path / "out"),
        )
    )
    assert (plan.url, plan.label, plan.upstream_port) == ("http://127.0.0.1:18301/v1", "ogx", 18300)
    assert (plan.model, plan.repetitions, key) == ("served-name", 2, "sk-peer")
    plan, key = gateway_plan(parsed("--upstream-port", "18300", "--out", str(tmp_path / "o2")))
    assert (plan.url, plan.label, plan.upstream_port, plan.model, key) == (
        None,
        "rollout",
        18300,
        "gateway",
        None,
    )
    plan, _ = gateway_plan(
        parsed("--upstream-port", "1", "--url", "http://h:2/v1", "--out", str(tmp_path / "o3"))
    )
    assert (plan.url, plan.label) == ("http://h:2/v1", "url")


# --- the fake model server ----------------------------------------------------------------


async def post_chat(port: int, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body)


async def test_the_fake_upstream_serves_on_the_port_it_is_given() -> None:
    port = free_port()
    upstream = FakeUpstream(port=port)
    spaced = json.dumps(  # another gateway's spacing: `"role": "tool"`
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}] * 2}
    ).encode()
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(upstream.serve)
            assert upstream.port == port
            answer = await post_chat(port, spaced)
            nursery.cancel_scope.cancel()
    assert '"id": "call_2"' in answer.text  # the tool messages counted, however spaced
    assert [(a.nbytes, a.digest) for a in upstream.arrivals] == [(len(spaced), body_digest(spaced))]
    assert upstream.arrivals[0].listed()[3] == content_digest(spaced)


async def test_the_fake_upstream_process_takes_a_fixed_port(tmp_path: Path) -> None:
    port = free_port()
    with trio.fail_after(DEADLINE):
        async with open_upstream(tmp_path / "up.log", port) as upstream:
            assert upstream.port == port
            await post_chat(port, b'{"messages":[{"role":"user","content":"x"}]}')
            (arrival,) = await upstream.new_arrivals()
            assert arrival.content == content_digest(
                b'{"messages":[{"role":"user","content":"x"}]}'
            )
            with pytest.raises(BenchError, match=f"is port {port} taken"):
                async with open_upstream(tmp_path / "up2.log", port):
                    pass


# --- the conversation the model is given ---------------------------------------------------


def chat(*messages: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({"model": "fake", "messages": list(messages), **fields}).encode()


CALL = {"id": "call_7", "type": "function", "function": {"name": "run", "arguments": '{"i":0}'}}
USER = {"role": "user", "content": "Work through the task."}
TOOL_OUT = {"role": "tool", "tool_call_id": "call_7", "content": "the of and"}


def test_the_content_digest_is_the_conversation_not_its_writing() -> None:
    plain = chat(USER, {"role": "assistant", "tool_calls": [CALL]}, TOOL_OUT)
    same = [
        # another gateway's way: content "" or null beside the calls, other keys, spacing,
        # its own call ids, text as parts
        chat(USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_OUT),
        chat(USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, TOOL_OUT, n=1),
        json.dumps(
            {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, TOOL_OUT]},
            indent=2,
        ).encode(),
        chat(
            USER,
            {"role": "assistant", "tool_calls": [{**CALL, "id": "call_x"}]},
            {**TOOL_OUT, "tool_call_id": "call_x"},
        ),
        chat(
            {"role": "user", "content": [{"type": "text", "text": USER["content"]}]},
            {"role": "assistant", "tool_calls": [CALL]},
            TOOL_OUT,
        ),
    ]
    other = [
        chat(USER, TOOL_OUT),  # the call dropped
        chat(USER),  # the history dropped
        chat(USER, {"role": "assistant", "tool_calls": [CALL]}, {**TOOL_OUT, "content": "the"}),
        chat(
            USER,
            {"role": "assistant", "tool_calls": [CALL]},
            {**TOOL_OUT, "tool_call_id": "call_8"},  # answers another call
        ),
        b"not json",
    ]
    assert {content_digest(b) for b in same} == {content_digest(plain)}
    assert len({content_digest(b) for b in [plain, *other]}) == len(other) + 1


# --- what the results say about a server's clients -----------------------------------------


def run_of(mode: str, size: int, digests: list[str], contents: list[str]) -> dict[str, Any]:
    turns = [
        {
            "overhead": 0.001,
            "turn_time": 0.002,
            "request_bytes": 10,
            "upstream_bytes": 10,
            "digest": d,
            "content_digest": c,
        }
        for d, c in zip(digests, contents, strict=True)
    ]
    return {
        "mode": mode,
        "size": size,
        "history_bytes": 10,
        "turns": turns,
        "stages_s": {},
        "repetition": 0,
    }


def test_a_client_whose_history_was_dropped_differs_and_is_no_fast_number() -> None:
    # ws-chain first: the reference is what most clients sent, not the first client's.
    runs = [run_of("ws-chain", 1000, ["short"], ["dropped"])] + [
        run_of(m, 1000, ["whole"], ["kept"]) for m in MODES[1:]
    ]
    assert same_bodies(runs) == {
        "compared": 4,
        "differ": ["ws-chain#0 at ~1000"],
        "other_bytes": [],
    }
    plan = GatewayPlan(sizes=(1000,), repetitions=1)
    results = build_results(plan, runs, 0.0)
    validate_gateway(results)
    by = {p["mode"]: p for p in results["points"]}
    assert by["ws-chain"]["bodies"] == "differ" and by["http-chain"]["bodies"] == "same"
    summary = render_gateway_summary(results)
    assert "| ws-chain | differs |" in summary and "| http-chain | 1.00 |" in summary
    # A differing point is not measured for the goals.
    partial = {"points": [{**p, "size": s} for p in results["points"] for s in (1000, 100000)]}
    assert {g["name"]: g["verdict"] for g in judge(partial)}["ws-chain-flat"] == "not measured"


def test_the_same_messages_in_other_bytes_are_not_another_conversation() -> None:
    runs = [run_of(m, 1000, ["a"], ["kept"]) for m in MODES]
    runs[1] = run_of("http-chain", 1000, ["b"], ["kept"])
    assert same_bodies(runs)["differ"] == []
    assert same_bodies(runs)["other_bytes"] == ["http-chain#0 at ~1000"]
    results = build_results(GatewayPlan(sizes=(1000,), repetitions=1), runs, 0.0)
    assert {p["mode"]: p["bodies"] for p in results["points"]}["http-chain"] == "other-bytes"
    summary = render_gateway_summary(results)
    assert "| http-chain | 1.00 |" in summary and "in other bytes" in summary


def test_results_from_before_content_digests_compare_the_bytes() -> None:
    runs = [run_of(m, 1000, ["a"], ["x"]) for m in MODES]
    for run in runs:
        for turn in run["turns"]:
            del turn["content_digest"]
    runs[2]["turns"][0]["digest"] = "b"
    assert same_bodies(runs)["differ"] == ["http-stateless#0 at ~1000"]


class StubClient:
    """A client whose turns take `seconds` of trio's clock each and whose `fail_at` turn
    raises what the server would make the real one raise."""

    def __init__(self, seconds: float, fail_at: int | None, upstream: StubUpstream) -> None:
        self.seconds = seconds
        self.fail_at = fail_at
        self.upstream = upstream
        self.turns = 0

    async def open(self, stack: AsyncExitStack) -> None:
        pass

    async def turn(self) -> tuple[float, float, int, dict[str, Any]]:
        sent = trio.current_time()
        await trio.sleep(self.seconds)
        self.upstream.pending.append(
            Arrival(at=sent + self.seconds / 2, nbytes=5, digest="d", content="c")
        )
        if self.turns == self.fail_at:
            raise ServerError("HTTP 400: previous_response_id needs a database")
        self.turns += 1
        return sent, trio.current_time(), 5, {}

    def next_input(self, response: dict[str, Any], turn: int) -> None:
        pass


class StubUpstream:
    def __init__(self) -> None:
        self.pending: list[Arrival] = []

    async def new_arrivals(self) -> list[Arrival]:
        taken, self.pending = self.pending, []
        return taken


async def test_a_conversation_the_server_fails_stops_and_the_others_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    plan = GatewayPlan(sizes=(1000,), turns=3, warm=1, repetitions=1)
    upstream = StubUpstream()
    endpoint = Endpoint(label="peer", base_url="http://127.0.0.1:1/v1")
    conversations = []
    for mode, fail_at in (("ws-chain", None), ("http-chain", 2), ("http-stateless", None)):
        conversation = _Conversation(mode, endpoint, 1000, plan, upstream)  # type: ignore[arg-type]
        conversation.client = StubClient(0.004, fail_at, upstream)  # type: ignore[assignment]
        conversations.append(conversation)

    async def metrics() -> dict[str, float]:
        return {}

    with trio.fail_after(DEADLINE):
        runs = await run_conversations(conversations, metrics)
    by = {r["mode"]: r for r in runs}
    assert [len(by[m]["turns"]) for m in ("ws-chain", "http-chain", "http-stateless")] == [3, 1, 3]
    assert "previous_response_id needs a database" in by["http-chain"]["error"]
    assert "error" not in by["ws-chain"] and "error" not in by["http-stateless"]
    # The failed turn's upstream request was taken with it, not counted as another's.
    assert all(t["overhead"] == pytest.approx(0.002) for r in runs for t in r["turns"])
    for run in runs:
        run["repetition"] = 0
    server = {"label": "peer", "url": endpoint.base_url, "started": False, "stage_metrics": False}
    results = build_results(
        plan, runs, 0.0, server=server, refused={"ws-stateless": "refused: no socket"}
    )
    validate_gateway(results)
    points = {p["mode"]: p for p in results["points"]}
    assert points["http-chain"]["error"] and points["http-chain"]["turns"] == 1
    assert points["ws-stateless"]["error"] == "refused: no socket"
    assert points["ws-stateless"]["turns"] == 0
    summary = render_gateway_summary(results)
    assert "| http-chain | failed |" in summary and "| ws-stateless | refused |" in summary
    assert "- ws-stateless refused" in summary
    assert "No stage table: peer serves no rollout metrics" in summary
    assert same_bodies(runs)["compared"] == 2


def test_validate_refuses_malformed_new_fields() -> None:
    results = build_results(GatewayPlan(sizes=(1000,), repetitions=1), [], 0.0)
    validate_gateway(results)
    for broken in (
        {**results, "refused": {"ws-chain": 1}},
        {**results, "points": [{**results["points"][0], "bodies": "maybe"}]},
        {**results, "meta": {**results["meta"], "server": "rollout"}},
    ):
        with pytest.raises(BenchError):
            validate_gateway(broken)


# --- a server the benchmark did not start ---------------------------------------------------


async def test_a_server_given_by_url_is_measured_against_the_fixed_port(tmp_path: Path) -> None:
    """A `rollout serve` started here (as a peer is, by whoever runs the benchmark), its model
    under another name, pointed at the port the benchmark then runs its fake model server on:
    every client measured, and the stage table there because the server has rollout's
    metrics."""
    port = free_port()
    models = tmp_path / "models.toml"
    models.write_text(
        f'[models.served-name]\nupstream = "http://127.0.0.1:{port}/v1"\nmodel = "fake"\n'
    )
    plan = GatewayPlan(
        sizes=(500,), repetitions=1, turns=1, warm=1, model="served-name", upstream_port=port
    )
    with trio.fail_after(DEADLINE):
        async with open_local_server(
            log_path=tmp_path / "peer.log", extra_args=("--models", str(models))
        ) as peer:
            plan = attrs.evolve(plan, url=peer.base_url, label="peer")
            results = await run_gateway(plan, tmp_path, lambda _: None, api_key="sk-any")
    validate_gateway(results)
    server = results["meta"]["server"]
    assert server == {
        "label": "peer",
        "url": peer.base_url,
        "started": False,
        "stage_metrics": True,
        "upstream_port": port,
    }
    assert "sk-any" not in json.dumps(results)  # the key is never written
    assert results["refused"] == {} and results["same_upstream_bodies"]["differ"] == []
    assert all(p["turns"] == 1 and p["overhead_ms"] > 0 for p in results["points"])
    assert all("decode" in r["stages_s"] for r in results["runs"])
    summary = render_gateway_summary(results)
    assert f"Server: peer at {peer.base_url}" in summary and "upstream_send" in summary


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parents[1] / "bench" / "results" / "gateway").rglob("results.json")),
    ids=lambda p: str(p.parent.relative_to(p.parents[2])),
)
def test_the_committed_results_still_read(path: Path) -> None:
    """Every committed gateway run, before and after the fields for other gateways: valid,
    rendered, and its comparison and goals the same worked out again."""
    results = json.loads(path.read_text())
    validate_gateway(results)
    assert "| ws-chain |" in render_gateway_summary(results)
    again = same_bodies(results["runs"])
    assert again["differ"] == results["same_upstream_bodies"]["differ"]
    assert again["other_bytes"] == results["same_upstream_bodies"].get("other_bytes", [])
    assert judge(results) == results["goals"]


async def test_a_mode_the_server_refuses_is_reported_and_the_others_measured(
    tmp_path: Path,
) -> None:
    """A server without WebSocket mode (`rollout serve --no-websocket`, given by URL): both
    WebSocket clients refused at the warm-up with the server's answer, the HTTP clients
    measured."""
    port = free_port()
    models = tmp_path / "models.toml"
    models.write_text(
        f'[models.gateway]\nupstream = "http://127.0.0.1:{port}/v1"\nmodel = "fake"\n'
    )
    plan = GatewayPlan(sizes=(500,), repetitions=1, turns=1, warm=1, upstream_port=port)
    with trio.fail_after(DEADLINE):
        async with open_local_server(
            log_path=tmp_path / "peer.log",
            extra_args=("--models", str(models), "--no-websocket"),
        ) as peer:
            plan = attrs.evolve(plan, url=peer.base_url, label="http-only")
            results = await run_gateway(plan, tmp_path, lambda _: None)
    validate_gateway(results)
    assert sorted(results["refused"]) == ["ws-chain", "ws-stateless"]
    assert all("ConnectionRejected" in e and "HTTP 426" in e for e in results["refused"].values())
    points = {p["mode"]: p for p in results["points"]}
    assert points["ws-chain"]["turns"] == 0 and points["ws-chain"]["error"]
    assert points["http-stateless"]["turns"] == 1 and points["http-stateless"]["error"] is None
    assert {r["mode"] for r in results["runs"]} == {"http-chain", "http-stateless"}
    assert "| ws-chain | refused |" in render_gateway_summary(results)
