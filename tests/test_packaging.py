"""Packaging and public surface: the wheel builds, installs and imports away from the checkout;
the console script runs; the wheel installs one import root, `rollout`; `import
rollout.protocol` stays sans-IO; the public names are deliberate."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rollout import protocol

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]
DISTRIBUTION = PYPROJECT["project"]["name"]


def run(args: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs
    )


# --- the public surface of `protocol` --------------------------------------------------------

EXPECTED_PROTOCOL_NAMES = {
    # constants
    "CLIENT_EVENT_TYPES",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "SERVER_EVENT_TYPES",
    "TERMINAL_EVENT_TYPES",
    "RESPONSE_END_TYPES",
    # codec
    "decode_client_event",
    "decode_create_body",
    "decode_server_event",
    "encode_json",
    "encode_msgpack",
    "from_wire",
    "make_converter",
    "to_wire",
    # steering (response.steer and its answers)
    "OUT_OF_STREAM",
    "STEER_EVENT_TYPES",
    "InvalidSteer",
    "RequiredInput",
    "ResponseSteer",
    "ResponseSteerAccepted",
    "ResponseSteerFailed",
    "ResponseSteerPending",
    "SteerAck",
    "SteerError",
    "SteerRef",
    "SteerSubmission",
    "steer_failed",
    "steer_items",
    # errors
    "ErrorBody",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    # connections (WebSocket mode) and server-sent events
    "DEFAULT_MAX_QUEUED_CREATES",
    "DEFAULT_MAX_REMEMBERED_RESPONSES",
    "ClientConnection",
    "ServerConnection",
    # lanes (stream_id)
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_LANES",
    "MAX_STREAM_ID_CHARS",
    "Lane",
    "valid_stream_id",
    "Move",
    "Phase",
    "sequence_problem",
    "DEFAULT_MAX_SSE_EVENT_SIZE",
    "ServerSentEvent",
    "SseDecoder",
    "encode_sse",
    "encode_sse_event",
    # builder
    "BuilderState",
    "InvalidToolPayload",
    "ResponseStream",
    "ResponseTracker",
    "iter_chunks",
    # client events
    "ClientEvent",
    "ResponseAppend",
    "ResponseCreate",
    "ResponseInject",
    # the multi-agent beta
    "MULTI_AGENT_BETA",
    "ROOT_AGENT",
    "AgentRef",
    "InjectError",
    "ResponseInjectCreated",
    "ResponseInjectFailed",
    "RootAgentView",
    "betas_of",
    "check_multi_agent",
    "inject_failed",
    "multi_agent_enabled",
    # server events
    "ContentPartAdded",
    "ContentPartDone",
    "CustomToolCallInputDelta",
    "CustomToolCallInputDone",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "ResponseCompleted",
    "ResponseCreated",
    "ResponseDone",
    "ResponseFailed",
    "ResponseInProgress",
    "ResponseIncomplete",
    "ResponseQueued",
    "ResponseRef",
    "ResponseEvent",
    "response_of",
    "named_response_of",
    "previous_id_of",
    "pending_calls_of",
    "steer_of",
    "lane_of",
    "ServerEvent",
    "SseErrorEvent",
    # items, parts, tools
    "ContentPart",
    "FunctionCall",
    "FunctionCallOutput",
    "FunctionTool",
    "InputFile",
    "InputImage",
    "InputText",
    "Item",
    "ItemReference",
    "Compaction",
    "Message",
    "NamespaceTool",
    "OutputText",
    "Reasoning",
    "ReasoningText",
    "Refusal",
    "SummaryText",
    "Tool",
    "ToolChoice",
    "ToolChoiceFunction",
    # tool calls of every kind, the items rollout carries, built-in tools
    "CALL_KINDS",
    "CallKind",
    "ToolCall",
    "ToolOutput",
    "CustomToolCall",
    "CustomToolCallOutput",
    "LocalShellAction",
    "LocalShellCall",
    "LocalShellCallOutput",
    "ShellAction",
    "ShellCall",
    "ShellCallOutput",
    "ShellOutput",
    "ApplyPatchOperation",
    "ApplyPatchCall",
    "ApplyPatchCallOutput",
    "ComputerCall",
    "ComputerCallOutput",
    "ComputerScreenshot",
    "OpaqueItem",
    "as_listed",
    "call_of",
    "output_of",
    "parts_of",
    "status_of",
    "CLIENT_BUILTIN_TOOLS",
    "BuiltinTool",
    "CustomTool",
    "CustomToolFormat",
    "ToolChoiceAllowed",
    "ToolChoiceBuiltin",
    "ToolChoiceCustom",
    "ToolChoiceMcp",
    "builtin_call_kind",
    "check_tool",
    "echo_tools",
    # the Response object
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputTokensDetails",
    "ReasoningConfig",
    "Response",
    "ResponseError",
    "TextConfig",
    "Usage",
    "RESPONSE_ERROR_CODES",
}


def test_protocol_public_names() -> None:
    """In the style of trio's `test_exports`: `__all__` is exactly the expected list, has no
    duplicates, every name exists, and nothing else public is reachable by accident."""
    assert len(protocol.__all__) == len(set(protocol.__all__))
    assert set(protocol.__all__) == EXPECTED_PROTOCOL_NAMES
    for name in protocol.__all__:
        assert hasattr(protocol, name), name
    public = {name for name in dir(protocol) if not name.startswith("_")}
    assert public == EXPECTED_PROTOCOL_NAMES


def test_protocol_star_import() -> None:
    namespace: dict[str, object] = {}
    exec("from rollout.protocol import *", namespace)
    assert set(namespace) - {"__builtins__"} == EXPECTED_PROTOCOL_NAMES


@pytest.mark.parametrize(
    "module",
    [
        "_builder",
        "_codec",
        "_converter",
        "_errors",
        "_events",
        "_items",
        "_response",
        "_steer",
        "_validate",
    ],
)
def test_private_modules_declare_their_names(module: str) -> None:
    mod = importlib.import_module(f"rollout.protocol.{module}")
    for name in mod.__all__:
        assert hasattr(mod, name), f"rollout.protocol.{module}.{name}"


SANS_IO_FORBIDDEN = [
    "trio",
    "trio_websocket",
    "hypercorn",
    "httpx",
    "socket",
    "selectors",
    "asyncio",
    "rollout.engine",
    "rollout.spec",
    "rollout.bench",
]


def test_import_protocol_is_sans_io() -> None:
    """`import rollout.protocol`, run from `/`, pulls in no async framework, no sockets and none
    of the other packages."""
    code = (
        "import sys, rollout.protocol\n"
        f"bad = [m for m in {SANS_IO_FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = run([sys.executable, "-c", code], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr


def test_protocol_sources_import_no_io_and_no_clock() -> None:
    """What `protocol/` imports, read from its source: no I/O, no clock (time, datetime),
    no randomness of its own; ids and timestamps come from the caller."""
    banned = {"time", "datetime", "random", "secrets", "uuid", "os", "socket", "trio", "asyncio"}
    found = []
    for path in sorted((ROOT / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert not found, found


def test_versions_agree() -> None:
    from rollout import engine

    assert protocol.__version__ == VERSION
    assert engine.__version__ == VERSION


# --- the wheel -------------------------------------------------------------------------------


def _copy_source(dest: Path) -> Path:
    """A clean copy of the checkout, so building never writes into it (setuptools leaves
    `build/` and `*.egg-info` behind)."""
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "__pycache__",
            ".*_cache",
            ".hypothesis",
            "build",
            "dist",
            "*.egg-info",
            "rollout-data",
            "bench-results",
        ),
    )
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp / "src")
    out = tmp / "dist"
    attempts = [
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, src]
    ]
    if importlib.util.find_spec("build") is not None:
        attempts.append([sys.executable, "-m", "build", "--wheel", "--outdir", out, src])
    # With build isolation pip fetches the build backend the pyproject asks for.
    attempts.append([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, src])
    logs = []
    for args in attempts:
        result = run(args)
        logs.append(f"$ {' '.join(map(str, args))}\n{result.stdout}{result.stderr}")
        found = sorted(out.glob(f"rollout_engine-{VERSION}-*.whl"))
        if result.returncode == 0 and found:
            return found[0]
    pytest.fail("could not build a wheel:\n" + "\n".join(logs))


def test_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points_text = zf.read(entry_points).decode()
    assert "[console_scripts]" in entry_points_text
    assert "rollout = rollout._cli:main" in entry_points_text
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rollout"}, tops  # one import root, nothing else at the top
    assert DISTRIBUTION == "rollout-engine"
    for package in ("", "protocol/", "engine/", "spec/", "bench/"):
        assert f"rollout/{package}py.typed" in names
        assert f"rollout/{package}__init__.py" in names
    assert "rollout/spec/checks.json" in names and "rollout/bench/results.schema.json" in names
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]


def test_wheel_installs_in_a_fresh_venv_and_runs_from_root(wheel: Path, tmp_path: Path) -> None:
    """`pip install rollout-engine` from the built wheel into a new virtual environment (its
    dependencies from the package index, or pip's cache): from `/`, `rollout --version` runs,
    `rollout.engine` imports from the venv, the spec finds its case list and schema in the
    package, and none of the old top-level names exist."""
    venv = tmp_path / "venv"
    result = run([sys.executable, "-m", "venv", venv])
    assert result.returncode == 0, result.stdout + result.stderr
    python = venv / "bin" / "python"
    result = run([python, "-m", "pip", "install", "--quiet", wheel], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    result = run([venv / "bin" / "rollout", "--version"], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"rollout {VERSION}"
    code = """
import importlib.util, json, rollout, rollout.engine, rollout.protocol, rollout.spec, rollout.bench
old = [n for n in ("engine", "protocol", "spec", "bench") if importlib.util.find_spec(n)]
print(json.dumps([rollout.engine.__file__, rollout.__version__, old]))
"""
    result = run([python, "-I", "-c", code], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    engine_file, version, old = json.loads(result.stdout)
    assert Path(engine_file).is_relative_to(venv) and version == VERSION
    assert old == []
    # The spec's data files are found inside the installed package (not beside a checkout).
    code = "from rollout.spec import load_cases; from rollout.spec._schema import load_schema\n"
    code += "print(len(load_cases()), bool(load_schema()))"
    result = run([python, "-I", "-c", code], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[1] == "True" and int(result.stdout.split()[0]) >= 40
    site = next((venv / "lib").glob("python3*/site-packages"))
    record = next(site.glob("rollout_engine-*.dist-info")) / "RECORD"
    tops = {line.split("/")[0].split(",")[0] for line in record.read_text().splitlines()}
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"rollout"}


def test_console_script_prints_version() -> None:
    script = BIN / "rollout"
    assert script.exists(), f"no console script at {script}"
    result = run([script, "--version"], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"rollout {VERSION}"
