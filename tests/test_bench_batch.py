"""`rollout bench --scenario real-model-batch`: its goals and summary, judged on results made
here (the run itself needs the llama extra and ~20 minutes: bench/results/real-model-batch/
holds one). Each goal can fail: re-reading, a transcript that moved, a model left idle, a peer
that finishes first, and a loop cut short (not measured, never a comparison)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rollout.bench._batch import (
    EMBEDDED,
    LLAMA_SERVER,
    LLAMA_SERVER_CACHE,
    evaluate_batch_goals,
    render_batch_summary,
    validate_batch,
)

TURNS = 3


def rollout(agent: int, *, turns: int = TURNS, digest: str | None = None) -> dict[str, Any]:
    return {
        "seconds": 10.0,
        "transcript": digest or f"t{agent}",
        "statuses": ["completed"] * turns,
        "turns": [
            {
                "seconds": 3.0,
                "status": "completed",
                "context_tokens": 100 * (t + 1) + agent,
                "cached_tokens": 90 * t,
                "output_tokens": 10,
            }
            for t in range(turns)
        ],
    }


def wave(server: str, mode: str, k: int, seconds: float, **model: float) -> dict[str, Any]:
    work = None
    if server == EMBEDDED:
        work = {
            "prompt_tokens": model.get("prompt", 500.0 * k),
            "decode_tokens": 30.0 * k,
            "prefill_seconds": model.get("busy", seconds) * 0.7,
            "decode_seconds": model.get("busy", seconds) * 0.3,
            "steps": 100.0,
            "sequences": 100.0 * min(k, 2),
        }
    return {
        "server": server,
        "mode": mode,
        "k": k,
        "seconds": seconds,
        "model": work,
        "rollouts": [rollout(i) for i in range(k)],
    }


def results() -> dict[str, Any]:
    alone = {
        mode: [{**rollout(i), "prompt_tokens": 500} for i in range(4)]
        for mode in ("ws-rollout", "ws-chain")
    }
    waves = []
    for k in (1, 2, 4):
        for mode in ("ws-rollout", "ws-chain"):
            waves.append(wave(EMBEDDED, mode, k, 10.0 * k))
        waves.append(wave(LLAMA_SERVER, "ws-chain", k, 30.0 * k))
        waves.append(wave(LLAMA_SERVER_CACHE, "ws-chain", k, 15.0 * k))
    return {
        "schema": "rollout-bench-real-model-batch/1",
        "meta": {
            "started": "2026-12-05T00:00:00Z",
            "seconds": 1.0,
            "argv": ["rollout"],
            "cpus": 2,
            "loadavg_start": None,
            "loadavg_end": None,
        },
        "plan": {
            "calls": TURNS - 1,
            "turns": TURNS,
            "threads": 2,
            "concurrency": [1, 2, 4],
            "servers": {EMBEDDED: [], LLAMA_SERVER: [], LLAMA_SERVER_CACHE: []},
        },
        "alone": alone,
        "waves": waves,
    }


def verdicts(doc: dict[str, Any]) -> dict[str, bool | None]:
    return {goal["goal"]: goal["met"] for goal in evaluate_batch_goals(doc)}


def test_a_run_that_meets_every_goal() -> None:
    doc = results()
    doc["goals"] = evaluate_batch_goals(doc)
    validate_batch(doc)
    assert all(goal["met"] is True for goal in doc["goals"]), doc["goals"]
    summary = render_batch_summary(doc)
    assert "| embedded | ws-chain | 4 | 40.0 |" in summary and "MISSED" not in summary


def _first(doc: dict[str, Any], server: str, mode: str, k: int) -> dict[str, Any]:
    return next(w for w in doc["waves"] if (w["server"], w["mode"], w["k"]) == (server, mode, k))


@pytest.mark.parametrize(
    ("breaking", "missed"),
    [
        ("reread", "embedded ws-chain: each agent's rollout reads at every K"),
        ("turn", "embedded ws-chain: each agent's rollout reads at every K"),
        ("transcript", "embedded ws-rollout: every rollout's transcript"),
        ("idle", "embedded ws-chain: wall time over the model work"),
        ("peer", f"sooner than {LLAMA_SERVER} "),
        ("cache", f"sooner than {LLAMA_SERVER_CACHE} "),
    ],
)
def test_each_goal_can_fail(breaking: str, missed: str) -> None:
    doc = copy.deepcopy(results())
    chain2 = _first(doc, EMBEDDED, "ws-chain", 2)
    if breaking == "reread":  # the wave read more than its agents alone
        assert chain2["model"] is not None
        chain2["model"]["prompt_tokens"] += 300
    elif breaking == "turn":  # a turn found less of its KV kept
        chain2["rollouts"][1]["turns"][2]["cached_tokens"] -= 40
    elif breaking == "transcript":
        _first(doc, EMBEDDED, "ws-rollout", 4)["rollouts"][3]["transcript"] = "other"
    elif breaking == "idle":  # the model idle a third of the wave
        assert chain2["model"] is not None
        chain2["model"]["prefill_seconds"] *= 0.6
        chain2["model"]["decode_seconds"] *= 0.6
    elif breaking == "peer":  # 2x sooner, not 2.5x
        _first(doc, LLAMA_SERVER, "ws-chain", 4)["seconds"] = 80.0
    elif breaking == "cache":
        _first(doc, LLAMA_SERVER_CACHE, "ws-chain", 2)["seconds"] = 19.0
    found = {goal: met for goal, met in verdicts(doc).items() if missed in goal}
    assert list(found.values()) == [False], (found, verdicts(doc))


def test_a_loop_cut_short_is_not_measured_never_compared() -> None:
    doc = results()
    _first(doc, LLAMA_SERVER, "ws-chain", 2)["rollouts"][0] = rollout(0, turns=1)
    goal = next(g for g in evaluate_batch_goals(doc) if f"than {LLAMA_SERVER} " in g["goal"])
    assert goal["met"] is None and "ended before 3 turns" in goal["detail"], goal
