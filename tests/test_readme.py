"""The README's examples run as written, after exactly the install steps it gives.

- The embedded-API example runs in the test environment.
- The `rollout serve` options table lists every option of `rollout serve --help`.
- The client examples (curl over HTTP and server-sent events, the raw WebSocket, the openai
  SDK's) run against a `rollout serve` installed the README's way: a copy of this checkout
  (the files git would commit), `python3 -m venv .venv && . .venv/bin/activate && pip install
  .` as the set-up command says, then the README's own `pip install` for the SDK, nothing else.
  Only the port differs (a free one for 8000). These need pip to reach the package index (its
  cache is enough) and curl; without them they skip with the reason, or fail under
  `ROLLOUT_REQUIRE_ALL`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout._cli import build_parser

from tests.client_harness import client_env, require, unavailable
from tests.test_server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL_TIMEOUT = 600  # a fresh venv and `pip install .` from the cache: ~30 s here
RUN_TIMEOUT = 60
SERVER_START = 60


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_embedded_example_runs(tmp_path: Path) -> None:
    blocks = [b for b in python_blocks() if "open_engine" in b]
    assert blocks, "README lost its embedded-API example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stdout


def test_set_up_commands_are_the_two_documented() -> None:
    commands = sh_blocks()
    assert commands[0].strip().endswith("rollout serve")
    assert commands[1].strip().endswith("pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = commands[1].strip().split("&& ", 2)[-1]
    assert test_command in ci


def _serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise AssertionError("no serve command")


def test_serve_options_table_lists_every_option() -> None:
    """Each `--option` of `rollout serve --help` has a row, each row names real options, and
    every option has help text."""
    text = README.read_text()
    table = text[text.index("### `rollout serve`") :]
    table = table[: table.index("\n\n", table.index("| option |"))]
    documented = {
        option
        for row in table.splitlines()[2:]
        for option in re.findall(r"`(--[a-z-]+)", row.split(" | ")[0])
    }
    serve = _serve_parser()
    options = {o for a in serve._actions for o in a.option_strings if o.startswith("--")}
    assert documented == options - {"--help"}
    for action in serve._actions:
        assert action.help, f"{action.option_strings} has no help text"


# --- the client examples, after the README's install steps --------------------------------


def _checkout_copy(dest: Path) -> Path:
    """The files of this checkout that git would commit (tracked, or new and not ignored)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        unavailable("the README install test copies a git checkout (no git or no .git here)")
    listed = subprocess.run(
        [git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def _sh(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=client_env(),
    )


@pytest.fixture(scope="module")
def readme_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout with the README's set-up (`rollout serve` aside: started by
    `readme_server`) and its SDK install run in it, literally."""
    require(shutil.which("bash"), "bash runs the README's commands")
    here = _checkout_copy(tmp_path_factory.mktemp("readme") / "rollout")
    set_up = sh_blocks()[0].strip()
    assert set_up.endswith(" && rollout serve")
    install = set_up.removesuffix(" && rollout serve")
    sdk = [b.strip() for b in sh_blocks()[2:] if "pip install" in b and "openai" in b]
    assert len(sdk) == 1, "the README gives one install command for the SDK"
    for command in (install, sdk[0]):
        done = _sh(command, here, INSTALL_TIMEOUT)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.splitlines()[-5:])
            if "No matching distribution" in done.stderr or "network" in done.stderr.lower():
                unavailable(f"pip could not install the README's packages: {tail}")
            raise AssertionError(f"{command!r} failed ({done.returncode}):\n{tail}")
    return here


@pytest.fixture(scope="module")
def readme_server(readme_checkout: Path) -> Iterator[int]:
    """`rollout serve` from the README's venv, in its checkout; yields its port."""
    port = free_port()
    process = subprocess.Popen(
        [str(readme_checkout / ".venv" / "bin" / "rollout"), "serve", "--port", str(port)],
        cwd=readme_checkout,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=client_env(),
    )
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if f"rollout serving on http://127.0.0.1:{port}/v1" in line:
                ready.set()
        ready.set()  # exited

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(SERVER_START) and process.poll() is None, "".join(lines[-20:])
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        reader.join(timeout=10)


def _at(port: int, text: str) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def curl_blocks() -> list[str]:
    return [b for b in sh_blocks() if b.lstrip().startswith("curl ")]


def client_blocks() -> list[str]:
    """Every Python example of the README but the embedded one: a client of `rollout serve`."""
    return [b for b in python_blocks() if "open_engine" not in b]


def test_the_readme_has_its_client_examples() -> None:
    assert len(curl_blocks()) == 1
    clients = client_blocks()
    assert any("websockets.sync.client" in b for b in clients), "the raw WebSocket example"
    assert any("client.responses.connect()" in b for b in clients), "the SDK example"
    assert all("http://127.0.0.1:8000/v1" in b or ":8000/v1/" in b for b in clients)


def test_curl_examples(readme_checkout: Path, readme_server: int) -> None:
    require(shutil.which("curl"), "the README's HTTP examples use curl")
    (block,) = curl_blocks()
    commands = re.split(r"\n(?=curl )", _at(readme_server, block).strip())
    assert len(commands) == 2
    plain = _sh(commands[0], readme_checkout, RUN_TIMEOUT)
    assert plain.returncode == 0, plain.stderr
    body = json.loads(plain.stdout)
    assert (body["object"], body["status"]) == ("response", "completed")
    assert body["output"][0]["content"][0]["text"]
    streamed = _sh(commands[1], readme_checkout, RUN_TIMEOUT)
    assert streamed.returncode == 0, streamed.stderr
    events = re.findall(r"^event: (\S+)$", streamed.stdout, flags=re.MULTILINE)
    assert events[0] == "response.created" and events[-1] == "response.completed", events


@pytest.mark.parametrize("index", range(len(client_blocks())))
def test_client_examples(readme_checkout: Path, readme_server: int, index: int) -> None:
    """Each runs with the README venv's python and prints what it says it prints."""
    block = client_blocks()[index]
    script = readme_checkout / f"example_{index}.py"
    script.write_text(_at(readme_server, block))
    python = readme_checkout / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), str(script)],
        cwd=readme_checkout,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=client_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip()
    assert out, "the example printed nothing"
    if "websockets.sync.client" in block:
        types = out.splitlines()
        assert types[0] == "response.created" and types[-1] == "response.completed", types
    elif "stream_id" in block:  # the lanes example: each lane's answer
        assert "'poem': '" in out and "'greeting': '" in out, out
