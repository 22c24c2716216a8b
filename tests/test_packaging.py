"""Packaging and public surface: the wheel builds, installs and imports away from the checkout;
the console script runs; `import protocol` stays sans-IO; the public names are deliberate."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

import protocol

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]


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
    # codec
    "decode_client_event",
    "decode_create_body",
    "decode_server_event",
    "encode_json",
    "encode_msgpack",
    "from_wire",
    "make_converter",
    "to_wire",
    # errors
    "ErrorBody",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    # builder
    "BuilderState",
    "InvalidToolPayload",
    "ResponseStream",
    "iter_chunks",
    # client events
    "ClientEvent",
    "ResponseAppend",
    "ResponseCreate",
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
    exec("from protocol import *", namespace)
    assert set(namespace) - {"__builtins__"} == EXPECTED_PROTOCOL_NAMES


@pytest.mark.parametrize(
    "module",
    ["_builder", "_codec", "_errors", "_events", "_items", "_response", "_validate"],
)
def test_private_modules_declare_their_names(module: str) -> None:
    mod = importlib.import_module(f"protocol.{module}")
    for name in mod.__all__:
        assert hasattr(mod, name), f"protocol.{module}.{name}"


def test_import_protocol_is_sans_io() -> None:
    """`import protocol` pulls in no async framework, no sockets and not the engine."""
    forbidden = ["trio", "trio_websocket", "hypercorn", "httpx", "socket", "asyncio", "engine"]
    code = (
        "import sys, protocol\n"
        f"bad = [m for m in {forbidden!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'trio' not in sys.modules\n"
    )
    result = run([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_versions_agree() -> None:
    import engine

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
            "*cache*",
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
        found = sorted(out.glob(f"rollout-{VERSION}-*.whl"))
        if result.returncode == 0 and found:
            return found[0]
    pytest.fail("could not build a wheel:\n" + "\n".join(logs))


def test_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points_text = zf.read(entry_points).decode()
    assert "[console_scripts]" in entry_points_text
    assert "rollout = engine._cli:main" in entry_points_text
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES)
    for package in ("protocol", "engine"):
        assert f"{package}/py.typed" in names
        assert f"{package}/__init__.py" in names
    assert not [n for n in names if n.startswith("tests/")]


def test_wheel_installs_and_imports_away_from_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    result = run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", target, wheel])
    assert result.returncode == 0, result.stdout + result.stderr
    venv_site = next(Path(p) for p in sys.path if p.endswith("site-packages"))
    # -I: no PYTHONPATH, no user site, no script dir; -S: no site-packages processing, so the
    # editable install's finder (a .pth hook) is never installed. Dependencies come from the
    # venv's site-packages, searched after the wheel's target dir.
    code = f"""
import sys
sys.path.insert(0, {str(target)!r})
sys.path.append({str(venv_site)!r})
import protocol, engine
assert not any("editable" in repr(f) for f in sys.meta_path), sys.meta_path
print(protocol.__file__)
print(engine.__file__)
print(protocol.__version__)
"""
    result = run([sys.executable, "-I", "-S", "-c", code], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    protocol_file, engine_file, version = result.stdout.split()
    assert Path(protocol_file).is_relative_to(target)
    assert Path(engine_file).is_relative_to(target)
    assert not Path(protocol_file).is_relative_to(ROOT)
    assert version == VERSION


def test_console_script_prints_version() -> None:
    script = BIN / "rollout"
    assert script.exists(), f"no console script at {script}"
    result = run([script, "--version"], cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"rollout {VERSION}"
