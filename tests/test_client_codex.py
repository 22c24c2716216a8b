"""OpenAI's Codex CLI (`@openai/codex`, pinned) runs an agent turn through `rollout serve`.

The real CLI, installed from the npm registry into a cache on first use, runs `codex exec` with
its default configuration apart from the model provider (rollout, over HTTP and over its
WebSocket mode), in a throwaway git repository. rollout routes the model to a scripted
chat-completions upstream that first asks for Codex's shell tool (`exec_command`) to print a
token made for this run, then, once the tool output comes back, answers with text quoting it.
Each run must exit 0 with that answer, the upstream must have received the command's output
through rollout, and the transport must be the one configured: over WebSocket, rollout's access
log shows the socket carried every create and no HTTP create at all (Codex silently falls back
to HTTP after a few failed connects, which must not pass).

Without node and npm (or without the registry) the tests skip; with `ROLLOUT_REQUIRE_ALL` set,
as in CI, they fail instead.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.client_harness import (
    REQUIRE_ALL_ENV,
    ClientResult,
    RolloutProcess,
    client_env,
    make_git_repo,
    npm_package,
    open_rollout_process,
    require,
    run_client,
)
from tests.upstream_harness import Exchange, call_chunks, open_fake_upstream, text_chunks

CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.171.0"
# A Codex run takes ~2 s here. Its slowest legitimate paths (five stream retries with backoff
# up to ~3 s, or seven WebSocket connects, ~7 s, before the HTTP fallback) end well inside a
# minute, so a run still going after one is hung.
CODEX_TIMEOUT = 60.0
# rollout logs a WebSocket connection when it closes; Codex drops its socket as it exits.
WS_CLOSE_TIMEOUT = 10.0
# The model names Codex asks for, each routed by rollout to the upstream: one unknown to Codex
# (it uses its fallback metadata: the default tools, `web_search` among them) and one it knows
# (it adds its `apply_patch` custom tool with a lark grammar, and `tool_search`).
MODEL = "rollout-codex-test"
KNOWN_MODEL = "gpt-5.5"
API_KEY_ENV = "ROLLOUT_CODEX_TEST_KEY"
SHELL_TOOL = "exec_command"


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    binary = npm_package(CODEX_PACKAGE, CODEX_VERSION, bin_name="codex")
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert version.stdout.strip() == f"codex-cli {CODEX_VERSION}", version
    return binary


def codex_config(base_url: str, *, websocket: bool, model: str) -> str:
    return f"""\
model = "{model}"
model_provider = "rollout"

[model_providers.rollout]
name = "rollout"
base_url = "{base_url}"
env_key = "{API_KEY_ENV}"
wire_api = "responses"
supports_websockets = {"true" if websocket else "false"}

# The only departures from Codex's defaults apart from the provider. Both switch off traffic to
# other hosts, which a test machine may not reach (ours has no internet): `plugins` syncs the
# plugin marketplace from github.com, api.github.com and chatgpt.com at startup, and `analytics`
# posts OTLP metrics to ab.chatgpt.com. Neither changes the tools or the request fields Codex
# sends to the provider (only `analytics_enabled` inside its turn-metadata string). Web search
# and every other default stay on.
[features]
plugins = false

[analytics]
enabled = false
"""


def models_toml(upstream_url: str, model: str) -> str:
    return f"""\
[models.{json.dumps(model)}]
upstream = "{upstream_url}"
model = "scripted"
retries = 0          # a failure must show, not be retried into an extra upstream request
read_timeout = 30
"""


def message_text(content: Any) -> str:
    """A chat message's content as text (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def tool_messages(body: Any) -> list[dict[str, Any]]:
    messages = body.get("messages", []) if isinstance(body, dict) else []
    return [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"]


def tool_names(body: Any) -> list[str]:
    tools = body.get("tools", []) if isinstance(body, dict) else []
    return [t["function"]["name"] for t in tools if isinstance(t, dict) and "function" in t]


class Script:
    """The upstream's two answers: a call to Codex's shell tool printing `marker` (the command
    itself does not contain it), then text quoting the marker if the tool output held it."""

    def __init__(self) -> None:
        token = secrets.token_hex(8)
        self.marker = f"rollout-codex-{token}"
        self.command = f"printf '%s-%s\\n' rollout-codex {token}"

    async def __call__(self, exchange: Exchange) -> None:
        outputs = tool_messages(exchange.body)
        if not outputs:
            arguments = json.dumps({"cmd": self.command})
            await exchange.stream(call_chunks([(SHELL_TOOL, arguments)]))
            return
        if any(self.marker in message_text(m.get("content")) for m in outputs):
            pieces = ["The command printed ", self.marker, "."]
        else:
            pieces = ["No command output arrived."]
        await exchange.stream(text_chunks(pieces))


def http_creates(server: RolloutProcess) -> list[dict[str, Any]]:
    return [
        r
        for r in server.access()
        if r.get("event") == "http"
        and r.get("method") == "POST"
        and str(r.get("path", "")).rstrip("/") in ("/v1/responses", "/responses")
    ]


def ws_connections(server: RolloutProcess) -> list[dict[str, Any]]:
    return [r for r in server.access() if r.get("event") == "ws_closed"]


async def run_codex(
    codex: Path, tmp_path: Path, base_url: str, *, websocket: bool, prompt: str, model: str
) -> ClientResult:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(codex_config(base_url, websocket=websocket, model=model))
    repo = make_git_repo(tmp_path / "repo")
    env = {k: v for k, v in client_env().items() if not k.startswith(("CODEX_", "OPENAI_"))}
    env.update({"CODEX_HOME": str(home), API_KEY_ENV: "sk-rollout-codex-test"})
    command = [
        str(codex),
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "read-only",
        "-c",
        "approval_policy=never",
        prompt,
    ]
    return await run_client(command, cwd=repo, env=env, time_limit=CODEX_TIMEOUT)


@pytest.mark.parametrize("model", [MODEL, KNOWN_MODEL])
@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_codex_exec_runs_a_tool_turn_through_rollout(
    codex_bin: Path, tmp_path: Path, transport: str, model: str
) -> None:
    websocket = transport == "websocket"
    script = Script()
    prompt = "Run the command you are given and tell me what it printed."
    async with open_fake_upstream(script) as (upstream_url, upstream):
        models = tmp_path / "models.toml"
        models.write_text(models_toml(upstream_url, model))
        data_dir = tmp_path / "rollout-data"
        async with open_rollout_process(data_dir=data_dir, models=models) as server:
            result = await run_codex(
                codex_bin, tmp_path, server.url, websocket=websocket, prompt=prompt, model=model
            )
            if websocket and result.returncode == 0:
                with trio.move_on_after(WS_CLOSE_TIMEOUT):
                    await server.wait_for(lambda s: bool(ws_connections(s)))
    # Asserted with both servers stopped (a failure reads as one assertion, not a nursery's
    # exception group).
    context = f"{result.describe()}\n--- rollout serve\n{server.tail()}"
    assert result.returncode == 0, context

    # The command ran: its output went Codex -> rollout -> the upstream, and the upstream's
    # answer quoting it came back as Codex's final message.
    assert upstream.hits == 2, (upstream.bodies, context)
    first, second = upstream.bodies
    assert not tool_messages(first) and SHELL_TOOL in tool_names(first), first
    if model == KNOWN_MODEL:  # Codex's grammar-constrained apply_patch reached the model
        patch = next(t for t in first["tools"] if t["function"]["name"] == "apply_patch")
        assert "lark grammar" in patch["function"]["description"], patch
    outputs = tool_messages(second)
    assert len(outputs) == 1, second
    assert script.marker in message_text(outputs[0].get("content")), outputs
    assert result.stdout.strip() == f"The command printed {script.marker}.", context
    # Codex's transcript (stderr) shows the command's own output line.
    assert script.marker in result.stderr.splitlines(), context

    # The transport was the one configured, proven from rollout's side: over WebSocket no
    # create came over HTTP (so the upstream's two requests came from the socket), and the
    # socket carried at least those two creates (Codex also prewarms on it).
    if websocket:
        assert http_creates(server) == [], context
        frames_in = sum(int(c.get("frames_in", 0)) for c in ws_connections(server))
        assert frames_in >= 2, (ws_connections(server), context)
    else:
        assert len(http_creates(server)) == 2, context
        assert ws_connections(server) == [], context


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_a_missing_prerequisite_skips_unless_required(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(REQUIRE_ALL_ENV, value)
    expected = pytest.fail.Exception if value == "1" else pytest.skip.Exception
    with pytest.raises(expected, match="no npm here"):
        require(False, "no npm here")
    require(True, "never raised")
