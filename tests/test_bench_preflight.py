"""`rollout bench` before it runs anything: one create of the scenario's shape against each
server (the preflight), whose refusal is one line naming the server and the fix, with nothing
written; and a run never replacing an earlier run's results unless told to (`--force`).

Before the preflight, a wrong key or model "ran" every step in no time, printed the servers'
error bodies and exited 0, over the last run's results.json and summary.md."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from rollout import bench
from rollout.bench._errors import PreflightError
from rollout.engine._serve import ServerConfig, open_server

from tests.test_bench import _bench_cli

DEADLINE = 60.0
TINY = [
    "--scenario", "alpha-demo", "--steps", "1", "--tool-tokens", "20", "--prompt-tokens", "20",
    "--output-tokens", "8", "--concurrency", "0", "--repetitions", "1", "--no-progress",
    "--no-plots",
]  # fmt: skip


def _config(url: str, tmp_path: Path, **changes: Any) -> Any:
    return bench.BenchConfig(
        points=(
            bench.SweepPoint(
                scenario=bench.PRESETS["alpha-demo"].with_(steps=1, tool_tokens=(20,)),
                tps=None,
                repetitions=1,
                modes=("ws-chain",),
            ),
        ),
        servers=(bench.ServerSpec(label="target", url=url),),
        out_dir=tmp_path,
        **changes,
    )


@asynccontextmanager
async def _server(**changes: Any) -> AsyncIterator[str]:
    async with open_server(ServerConfig(port=0, data_dir=None, **changes)) as url:
        yield url


async def test_a_wrong_key_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with _server(api_keys=("sk-right",)) as url:
            config = _config(url, tmp_path, api_key="sk-wrong")
            with pytest.raises(PreflightError) as exc:
                await bench.run_benchmark(config)
    message = str(exc.value)
    assert message.startswith("target: refused the benchmark's first request (HTTP 401")
    assert message.endswith("; pass the server's key with --api-key")
    assert "\n" not in message


async def test_a_model_the_server_lacks_is_named_with_the_fix(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with _server() as url:
            config = _config(url, tmp_path, model="no-such-model")
            with pytest.raises(PreflightError) as exc:
                await bench.run_benchmark(config)
    message = str(exc.value)
    assert "the server does not serve the model 'no-such-model'" in message, message
    assert f"GET {url.rstrip('/')}/models lists them" in message


def test_with_local_and_an_unknown_model_says_how_to_serve_it(tmp_path: Path) -> None:
    done = _bench_cli(*TINY, "--with-local", "--model", "llama-3", "--out", "out", cwd=tmp_path)
    assert done.returncode == 1, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "the server does not serve the model 'llama-3'" in lines[0]
    assert "--local LABEL='--models FILE'" in lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_an_earlier_run_is_kept_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"schema": "rollout-bench/7", "old": True}))
    (out / "overhead.png").write_bytes(b"old plot")
    done = _bench_cli(*TINY, "--out", "out", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "rollout bench: out holds an earlier run (overhead.png, results.json); choose another "
        "--out, or pass --force to replace it\n"
    )
    assert json.loads((out / "results.json").read_text())["old"] is True
    done = _bench_cli(*TINY, "--force", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "old" not in json.loads((out / "results.json").read_text())
    assert not (out / "overhead.png").exists()  # (--no-plots: the old plot is not left behind)
