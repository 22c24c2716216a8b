"""`rollout` and `rollout serve` as a user meets them: the exact message and exit status of each
mistake a user can make by a typo, and the log lines a running server writes.

Each test runs the real command in a subprocess with a timeout. Failures to start are one line
on stderr (no traceback unless `--debug`) and leave nothing behind: the port is bound before the
data folder is made.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.server_harness import open_ws
from tests.test_server_process import free_port

ROLLOUT = [sys.executable, "-m", "rollout"]
TIMEOUT = 60  # seconds for a command that fails at start (an import of the engine)
DEADLINE = 60


def _serve_parser() -> argparse.ArgumentParser:
    from rollout._cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise AssertionError("no serve command")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ROLLOUT, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd
    )


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    done = run(cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "usage: rollout [-h] [--version] COMMAND ...\n"
        "rollout: a command is required: serve, conform or bench (rollout --help says more)\n"
    )


def test_port_in_use(tmp_path: Path, listening: int) -> None:
    done = run("serve", "--port", str(listening), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"rollout serve: 127.0.0.1:{listening} is already in use (another rollout serve?); "
        "stop that server or pick another --port.\n"
    )
    assert not (tmp_path / "rollout-data").exists()  # bound before the store opened


def test_port_in_use_with_debug_shows_the_traceback(tmp_path: Path, listening: int) -> None:
    done = run("serve", "--port", str(listening), "--debug", cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.rstrip().endswith(f"StartupError: 127.0.0.1:{listening} is already in "
                                         "use (another rollout serve?); stop that server or "
                                         "pick another --port.")  # fmt: skip
    assert not (tmp_path / "rollout-data").exists()


@pytest.mark.parametrize("port", ["99999", "-1", "abc", "80.5"])
def test_bad_port(tmp_path: Path, port: str) -> None:
    """Out of range or not a number: the same one line, as every mistake in the arguments."""
    done = run("serve", "--port", port, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == f"rollout serve: --port: expected a port number 0-65535, got {port!r}\n"
    assert not (tmp_path / "rollout-data").exists()


def test_an_unknown_option_is_one_line(tmp_path: Path) -> None:
    done = run("serve", "--prot", "8000", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "rollout serve: unrecognized arguments: --prot 8000 (rollout serve --help lists the "
        "options)\n"
    )


# --- serve --help ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_help(tmp_path_factory: pytest.TempPathFactory) -> str:
    done = run("serve", "--help", cwd=tmp_path_factory.mktemp("help"))
    assert (done.returncode, done.stderr) == (0, "")
    return done.stdout


def test_the_help_starts_with_a_usage_line_without_a_hint_to_itself(serve_help: str) -> None:
    assert serve_help.startswith("usage: rollout serve [options]\n\n")
    assert "--help lists" not in serve_help


def test_the_help_lists_the_exit_statuses(serve_help: str) -> None:
    assert serve_help.endswith(
        "exit status:\n"
        "  0    stopped (SIGINT or SIGTERM) after a graceful shutdown\n"
        "  1    could not start: the port, the host, the data folder, or the --store\n"
        "       database (unreachable, or refusing the connection)\n"
        "  2    a bad argument or models file (nothing was started)\n"
        "  130  interrupted before the server was up\n"
    )


def test_the_deflate_switches_say_plainly_which_is_the_default(serve_help: str) -> None:
    text = " ".join(serve_help.split())
    assert (
        "--websocket-deflate accept permessage-deflate when a WebSocket client offers it (the "
        "openai SDK and Codex do): fewer bytes on the wire for more CPU per frame; for slow or "
        "metered links (permessage-deflate is off by default; this turns it on) "
    ) in text
    assert (
        "--no-websocket-deflate decline permessage-deflate: frames go uncompressed, the faster "
        "choice on loopback, LAN and datacenter networks (the default) "
    ) in text
    assert "(default off)" not in text[text.index("--websocket-deflate") : text.index("--models")]


# The metavariables of serve's options: a unit or a short noun, one style.
METAVARS = {"HOST", "PORT", "DIR", "FILE", "URL", "KEY", "ORIGIN", "LEVEL", "FORMAT"}
METAVARS |= {"N", "BYTES", "MB", "SECONDS", "FRACTION"}


def test_every_metavariable_is_a_unit_or_a_short_noun(serve_help: str) -> None:
    shown = re.findall(r"^  (--[a-z0-9-]+)(?: (\S+))?", serve_help, flags=re.MULTILINE)
    odd = {option: metavar for option, metavar in shown if metavar and metavar not in METAVARS}
    assert odd == {}
    # The help was read whole: every option is in it, each that takes a value with its
    # metavariable.
    actions = [a for a in _serve_parser()._actions if a.option_strings != ["-h", "--help"]]
    assert {option for option, _ in shown} == {a.option_strings[-1] for a in actions}
    assert {option for option, metavar in shown if metavar} == {
        a.option_strings[-1] for a in actions if a.nargs != 0
    }


def test_an_empty_api_key_is_refused(tmp_path: Path) -> None:
    """`--api-key ""` would turn authentication on with a key no client can send: refused, one
    line, before anything starts."""
    done = run("serve", "--api-key", "", "--port", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "rollout serve: --api-key: an empty key would refuse every request without one and "
        "admit none; give a key, or leave --api-key out to serve without authentication.\n"
    )
    assert not (tmp_path / "rollout-data").exists()


async def test_the_start_up_line_says_when_keys_are_required(tmp_path: Path) -> None:
    port = free_port()
    command = [*ROLLOUT, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    command += ["--api-key", "sk-one"]
    err: list[str] = []
    ready = trio.Event()
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                assert process.stderr is not None
                nursery.start_soon(_collect, process.stderr, err, ready)
                await ready.wait()
                process.send_signal(signal.SIGTERM)
                await process.wait()
    finally:
        await _reap(process)
    serving = [line for line in err if "serving on" in line]
    assert serving[0].endswith(
        f"rollout serving on http://127.0.0.1:{port}/v1 (WebSocket on; API key required: "
        "Authorization: Bearer KEY)"
    )


def test_unknown_host(tmp_path: Path) -> None:
    done = run("serve", "--host", "no-such-host.invalid", "--port", "0", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(
        "rollout serve: cannot listen on no-such-host.invalid:0: unknown host ("
    )
    assert done.stderr.endswith("); use an IP address or a name that resolves (--host).\n")
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "rollout-data").exists()


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a folder")
    done = run("serve", "--port", "0", "--data-dir", "taken", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "rollout serve: cannot use taken as the data folder: File exists; pick another "
        "--data-dir.\n"
    )


def test_a_store_that_is_not_a_database(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "responses.sqlite3").write_bytes(b"not a database " * 10)
    done = run("serve", "--port", "0", "--data-dir", "data", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "rollout serve: cannot open data/responses.sqlite3: file is not a database; move the "
        "file away or pick another --data-dir.\n"
    )


def test_a_store_that_refuses_the_connection(tmp_path: Path) -> None:
    """A real refused port (1: nothing listens there): one line naming the database without
    the URL's credentials and libpq's cause in short (not its second, hint line), and the
    status of a server that could not start."""
    url = "postgresql://someone:s3cret@127.0.0.1:1/rollout"
    done = run("serve", "--port", "0", "--store", url, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "rollout serve: cannot open the store at postgresql://127.0.0.1:1/rollout: Connection "
        "refused; check --store and that PostgreSQL is running there.\n"
    )
    assert not (tmp_path / "rollout-data").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///x.db", "expected a postgresql:// URL, got 'sqlite:///x.db'"),
        ("postgresql://u:pw@db:abc/x", "expected a port number in the URL, got 'abc'"),
        ("postgresql://db/x?colour=blue", 'invalid URI query parameter: "colour"'),
    ],
)
def test_a_store_url_that_cannot_work(tmp_path: Path, url: str, message: str) -> None:
    done = run("serve", "--port", "0", "--store", url, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"rollout serve: --store: {message}\n"


def test_port_in_use_in_json_mode_is_one_json_line(tmp_path: Path, listening: int) -> None:
    done = run("serve", "--port", str(listening), "--log-format", "json", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["logger"] == "rollout.server"
    assert record["message"].startswith(f"127.0.0.1:{listening} is already in use")


# --- a running server's log lines ----------------------------------------------------------


# A request for a model the server lacks, over HTTP and WebSocket: where to find the others.
UNKNOWN_MODEL = {
    "message": "The model `gpt-4o` does not exist or you do not have access to it; "
    "GET /v1/models lists the models of this server.",
    "type": "invalid_request_error",
    "param": "model",
    "code": "model_not_found",
}


async def _collect(
    stream: trio.abc.ReceiveStream,
    lines: list[str],
    ready: trio.Event,
    seen: dict[str, trio.Event] | None = None,
) -> None:
    """Read `stream`'s lines into `lines`; set `ready` at "serving on", and each of `seen`'s
    events at a line containing its key."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            lines.append(raw.decode(errors="replace"))
            if "serving on" in lines[-1]:
                ready.set()
            for key, event in (seen or {}).items():
                if key in lines[-1]:
                    event.set()
    if buffer:
        lines.append(buffer.decode(errors="replace"))


async def _serve_and_exercise(tmp_path: Path, *extra: str) -> tuple[int, list[str], list[str], int]:
    """Start `rollout serve`, make HTTP (JSON, SSE, an error, a 404) and WebSocket requests,
    SIGTERM it; returns (exit status, stdout lines, stderr lines, port)."""
    port = free_port()
    command = [*ROLLOUT, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    command += ["--graceful-timeout", "2", *extra]
    out: list[str] = []
    err: list[str] = []
    ready = trio.Event()
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None and process.stderr is not None
                nursery.start_soon(_collect, process.stdout, out, trio.Event())
                nursery.start_soon(_collect, process.stderr, err, ready)
                await ready.wait()
                url = f"http://127.0.0.1:{port}/v1"
                async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                    body = {"model": "sim", "input": "hi"}
                    assert (await http.post("/responses", json=body)).status_code == 200
                    streamed = await http.post("/responses", json={**body, "stream": True})
                    assert streamed.status_code == 200
                    bad = await http.post("/responses", json={"model": "gpt-4o", "input": "x"})
                    assert bad.status_code == 404
                    assert bad.json() == {"error": UNKNOWN_MODEL}
                    assert (await http.get("/nowhere")).status_code == 404
                async with open_ws(url) as ws:
                    events = await ws.create(model="sim", input="hello")
                    assert events[-1].type == "response.completed"
                    await ws.send({"type": "response.create", "model": "gpt-4o", "input": "x"})
                    await ws.recv()
                    assert ws.raw[-1]["error"] == UNKNOWN_MODEL
                    assert (ws.raw[-1]["type"], ws.raw[-1]["status"]) == ("error", 404)
                process.send_signal(signal.SIGTERM)
                code = await process.wait()
    finally:
        await _reap(process)
    return code, out, err, port


async def test_json_logs_are_one_json_object_per_line(tmp_path: Path) -> None:
    code, out, err, port = await _serve_and_exercise(tmp_path, "--log-format", "json")
    assert code == 0, err[-10:]
    assert out == []
    records = [json.loads(line) for line in err]  # every line, start-up and shutdown included
    for record in records:
        assert {"timestamp", "level", "logger", "message"} <= record.keys(), record
    messages = [r["message"] for r in records]
    assert f"rollout serving on http://127.0.0.1:{port}/v1 (WebSocket on)" in messages
    assert not any("Running on" in m for m in messages)  # hypercorn's line, without /v1
    # SIGTERM once every response had ended: nothing to wait for.
    assert "received SIGTERM: no responses in flight, stopping now" in messages
    access = [r for r in records if r["logger"] == "rollout.access"]
    http = [(r["method"], r["path"], r["status"]) for r in access if r["event"] == "http"]
    assert http == [
        ("POST", "/v1/responses", 200),
        ("POST", "/v1/responses", 200),
        ("POST", "/v1/responses", 404),
        ("GET", "/v1/nowhere", 404),
    ]
    closed = [r for r in access if r["event"] == "ws_closed"]
    assert len(closed) == 1 and closed[0]["frames_in"] == 2 and closed[0]["seconds"] > 0
    assert all(isinstance(r["seconds"], float) for r in access)


async def test_text_logs_are_clean_lines(tmp_path: Path) -> None:
    code, out, err, port = await _serve_and_exercise(tmp_path)
    assert code == 0, err[-10:]
    assert out == []
    serving = [line for line in err if "serving on" in line]
    assert len(serving) == 1
    assert serving[0].endswith(
        f" INFO rollout.server: rollout serving on http://127.0.0.1:{port}/v1 (WebSocket on)"
    )
    assert not any("hypercorn" in line or "Running on" in line for line in err), err
    access = [line for line in err if " rollout.access: " in line]
    assert len(access) == 5
    assert " rollout.access: POST /v1/responses 404 " in access[2]
    assert not any("{" in line for line in err), err  # no JSON mixed into the text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-connections", "-5"], "--max-connections: expected a number > 0, got -5"),
        (["--graceful-timeout", "soon"], "--graceful-timeout: expected a number, got 'soon'"),
        (["--render-cache-ttl", "0"], "--render-cache-ttl: expected a number > 0, got 0"),
        (["--workers"], "--workers: expected one argument"),
        (
            ["--log-level", "loud"],
            "--log-level: invalid choice: 'loud' (choose from 'debug', 'info', 'warning', 'error')",
        ),
    ],
)
def test_bad_numbers_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = run("serve", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == f"rollout serve: {message}\n"
    assert not (tmp_path / "rollout-data").exists()


def test_a_missing_models_file(tmp_path: Path) -> None:
    done = run("serve", "--models", "nope.toml", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        "rollout serve: nope.toml: No such file or directory\n",
    )


def test_text_lines_show_a_librarys_fields_and_not_ours() -> None:
    """stamina logs a retry as its name with the details in `extra`: text shows them; an
    access line's fields are already its message."""
    import logging

    from rollout.engine._logging import formatter

    text = formatter("text")
    retry = logging.makeLogRecord(
        {"name": "stamina", "levelname": "WARNING", "msg": "stamina.retry_scheduled",
         "stamina.retry_num": 1, "stamina.caused_by": "ConnectError()"}
    )  # fmt: skip
    assert text.format(retry).endswith(
        " WARNING stamina: stamina.retry_scheduled stamina.retry_num=1 "
        "stamina.caused_by=ConnectError()"
    )
    access = logging.makeLogRecord(
        {"name": "rollout.access", "levelname": "INFO", "msg": "GET / 404", "event": "http"}
    )
    assert text.format(access).endswith(" INFO rollout.access: GET / 404")
    record = json.loads(formatter("json").format(retry))
    assert record["stamina.retry_num"] == 1 and record["logger"] == "stamina"


async def test_ctrl_c_twice_stops_at_once_and_cleanly(tmp_path: Path) -> None:
    """The first SIGINT starts the graceful shutdown (a 60 s grace period here) and says what
    it waits for, how long, and how to stop at once; the second ends it at once, in one line:
    the streamed response still running ends with its terminal event, the process exits 0,
    and no traceback is printed (it was a KeyboardInterrupt's, exit 1)."""
    port = free_port()
    command = [*ROLLOUT, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    command += ["--graceful-timeout", "60"]
    err: list[str] = []
    ready = trio.Event()
    events: list[str] = []
    process = await trio.lowlevel.open_process(
        command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                assert process.stderr is not None
                shutting = trio.Event()
                seen = {"received SIGINT: waiting": shutting}
                nursery.start_soon(_collect, process.stderr, err, ready, seen)
                await ready.wait()
                started = trio.Event()

                async def stream() -> None:
                    body = {"model": "sim:tokens=100000,tps=50", "input": "Go.", "stream": True}
                    async with (
                        httpx.AsyncClient(timeout=30) as http,
                        http.stream(
                            "POST", f"http://127.0.0.1:{port}/v1/responses", json=body
                        ) as resp,
                    ):
                        async for line in resp.aiter_lines():
                            if line.startswith("event: "):
                                events.append(line.removeprefix("event: "))
                                if line.endswith("output_text.delta"):
                                    started.set()

                nursery.start_soon(stream)
                await started.wait()
                process.send_signal(signal.SIGINT)
                await shutting.wait()  # taken (two at once may arrive as one)
                process.send_signal(signal.SIGINT)
                with trio.fail_after(10):  # far less than the grace period
                    code = await process.wait()
    finally:
        await _reap(process)
    assert code == 0, err[-20:]
    assert events[-1] == "response.incomplete"  # interrupted, with its terminal event
    server = [line.split(" rollout.server: ", 1)[1] for line in err if " rollout.server: " in line]
    first = server.index(
        "received SIGINT: waiting up to 60 s (--graceful-timeout) for 1 response in flight; "
        "press Ctrl-C again to stop now"
    )
    assert server[first + 1 :] == [
        "received SIGINT again: interrupting 1 response in flight, stopping now",
        "server stopped; flushing post-inference work",
    ]
    assert not any("Traceback" in line for line in err), err


async def _reap(process: trio.Process) -> None:
    """Kill a server the test left running, and wait for it (even when cancelled)."""
    if process.returncode is None:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
