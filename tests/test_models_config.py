"""The model registry file (`rollout serve --models FILE`): the docs' example parses into
the registry it describes, every mistake is a `ConfigError` naming the key, `rollout serve`
refuses a bad file with exit status 2, and a loaded file routes requests (aliases included)
to a real upstream.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rollout.engine._config import ConfigError, load_registry, registry_from_mapping
from rollout.engine._defaults import default_registry
from rollout.engine._upstream import UpstreamBackend
from rollout.protocol import RemoteProtocolError

from tests.doc_blocks import blocks
from tests.upstream_harness import SIM_MODEL, open_rollout

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 20


def readme_toml(kind: str = "upstream") -> str:
    """The docs' models-file example of upstream models (or of `gguf` files): docs/serving.md."""
    found = [b.code for b in blocks("toml") if f"\n{kind} = " in b.code]
    assert len(found) == 1, f"the docs have one TOML example of {kind} models"
    return found[0]


def upstream(registry: Any, model: str) -> UpstreamBackend:
    backend = registry.resolve(model).backend
    assert isinstance(backend, UpstreamBackend)
    return backend


def test_readme_example_parses_into_the_registry_it_describes() -> None:
    registry = registry_from_mapping(tomllib.loads(readme_toml()), source="docs/serving.md")
    names = registry.names()
    for name in ("qwen", "llama", "ollama-qwen", "hosted", "llama3", "gpt-5"):
        assert name in names
    # The built-in simulated models stay available.
    assert {"sim", "sim-65", "sim-1000", "sim-4000"} <= set(names)
    assert registry.resolve("sim:steps=2").name == "sim"

    qwen = registry.resolve("qwen")
    assert qwen.context_window == 32768
    cfg = upstream(registry, "qwen").config
    assert (cfg.base_url, cfg.model) == ("http://127.0.0.1:8001/v1", "Qwen/Qwen2.5-7B-Instruct")
    assert registry.resolve("ollama-qwen").context_window == 400_000  # the default
    assert upstream(registry, "ollama-qwen").config.model == "qwen2.5:7b"

    hosted = upstream(registry, "hosted").config
    assert hosted.api_key_env == "EXAMPLE_API_KEY"
    assert hosted.read_timeout == 120.0 and isinstance(hosted.read_timeout, float)
    assert (hosted.retries, hosted.max_connections) == (2, 64)
    assert hosted.connect_timeout == 5.0  # not in the file: the default

    # Aliases resolve to the model they name: per model, and in [aliases].
    assert registry.resolve("llama3").name == "llama"
    assert registry.resolve("llama3").backend is registry.resolve("llama").backend
    assert registry.resolve("gpt-5").name == "qwen"
    assert registry.resolve("gpt-5").model == "gpt-5"  # the client's string is kept
    # Upstream models take no `:k=v` parameters.
    with pytest.raises(RemoteProtocolError) as info:
        registry.resolve("qwen:temperature=0")
    assert info.value.code == "model_not_found"


def test_aliases_may_name_sim_strings_and_chain() -> None:
    registry = registry_from_mapping(
        {
            "models": {"up": {"upstream": "http://127.0.0.1:9/v1", "aliases": ["up-alias"]}},
            "aliases": {"fast": "sim:steps=3,tps=4000", "faster": "fast", "gw": "up-alias"},
        }
    )
    route = registry.resolve("faster")
    assert route.name == "sim" and route.params == {"steps": "3", "tps": "4000"}
    assert registry.resolve("gw").name == "up"
    assert upstream(registry, "up").config.model == "up"  # `model` defaults to the name


def test_an_empty_file_is_the_builtin_registry() -> None:
    registry = registry_from_mapping({})
    assert "sim" in registry.names()


X = '[models.x]\nupstream = "http://h/v1"\n'  # a valid model table, to add a mistake to
BAD: list[tuple[str, str]] = [
    # (TOML, what the message must contain)
    ("[server]\nport = 1\n", "unknown table [server]"),
    (X + "bogus = 1\n", "models.x.bogus: unknown key"),
    (X + "retry_backoff = 1.0\n", "models.x.retry_backoff: unknown key"),
    (X + 'retries = "2"\n', "models.x.retries: expected int"),
    (X + "retries = true\n", "models.x.retries: expected int"),
    (X + "retries = -1\n", "models.x.retries: expected a number >= 0"),
    (X + 'read_timeout = "slow"\n', "models.x.read_timeout: expected float"),
    (X + "read_timeout = 0\n", "models.x.read_timeout: expected a number > 0"),
    (X + "max_connections = 0\n", "models.x.max_connections: expected a number > 0"),
    (X + "context_window = 1.5\n", "models.x.context_window: expected int"),
    (X + "api_key_env = 1\n", "models.x.api_key_env: expected str"),
    (X + "model = 7\n", "models.x.model: expected str"),
    (X + "description = []\n", "models.x.description: expected str"),
    (X + 'aliases = "y"\n', "models.x.aliases: expected an array"),
    (X + "aliases = [1]\n", "models.x.aliases: expected an array"),
    (
        '[models.x]\nmodel = "m"\n',
        "models.x: `upstream` (the base URL) or `gguf` (a model file) is required",
    ),
    ("[models.x]\nupstream = 5\n", "models.x.upstream: expected str"),
    (
        '[models.x]\nupstream = "127.0.0.1:8001/v1"\n',
        "models.x.upstream: expected an http:// or https:// URL",
    ),
    (
        '[models."qwen:7b"]\nupstream = "http://h/v1"\n',
        "models.qwen:7b: a model name can't contain ':'",
    ),
    ("models = 5\n", "[models] must be a table"),
    ("[models]\nx = 5\n", "models.x: expected a table"),
    ("aliases = 5\n", "[aliases] must be a table"),
    ("[aliases]\ngpt = 5\n", "aliases.gpt: expected a model string"),
    ('[aliases]\ngpt = "no-such-model"\n', "aliases.gpt: 'no-such-model' is not a model"),
    # Built-in names stay the built-in models; an alias never hides a model of the file.
    ('[models.sim]\nupstream = "http://h/v1"\n', "models.sim: `sim` is a built-in model"),
    (X + 'aliases = ["sim-65"]\n', "models.x.aliases: `sim-65` is a built-in model"),
    ('[aliases]\nsim = "sim:steps=2"\n', "aliases.sim: `sim` is a built-in model"),
    ('[aliases]\n"sim-4000" = "sim"\n', "aliases.sim-4000: `sim-4000` is a built-in model"),
    (X + '[aliases]\nx = "sim"\n', "aliases.x: `x` is a model of this file"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_mistakes_are_config_errors_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        registry_from_mapping(tomllib.loads(text), source="models.toml")
    assert str(info.value).startswith("models.toml: ")
    assert message in str(info.value)


def test_load_registry_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text("[models.x\n")
    with pytest.raises(ConfigError, match=r"models\.toml: .*line 1"):
        load_registry(bad)
    with pytest.raises(ConfigError, match="No such file"):
        load_registry(tmp_path / "missing.toml")
    bad.write_text(X + 'retries = "two"\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: models\.x\.retries"):
        load_registry(bad)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            X + 'retries = "two"\n',
            "models.x.retries: expected int",
        ),
        ("[models.x\n", "Expected ']'"),
        (None, "No such file or directory"),
    ],
)
def test_serve_with_a_bad_models_file_exits_2(
    tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "models.toml"
    if text is not None:
        path.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "rollout", "serve", "--models", str(path), "--port", "0",
         "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"rollout serve: {path}: ")
    assert message in done.stderr
    assert not (tmp_path / "data").exists()  # refused before opening anything


async def test_a_loaded_file_routes_to_its_upstream(tmp_path: Path) -> None:
    """A file like the README's, its model pointing at a real rollout (A): requests to the
    model and to its aliases reach A, which answers as the simulated model."""
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            path = tmp_path / "models.toml"
            path.write_text(
                f'[models.local]\nupstream = "{a}"\nmodel = "{SIM_MODEL}"\n'
                'aliases = ["local-alias"]\nretries = 0\nread_timeout = 30\n\n'
                '[aliases]\n"gpt-5" = "local"\n'
            )
            registry = load_registry(path)
            async with (
                open_rollout(registry=registry) as b,
                httpx.AsyncClient(timeout=10) as client,
            ):
                texts = []
                for model in ("local", "local-alias", "gpt-5"):
                    resp = await client.post(f"{b}/responses", json={"model": model, "input": "Hi"})
                    body = resp.json()
                    assert body["status"] == "completed", body
                    assert body["model"] == model
                    texts.append(body["output"][0]["content"][0]["text"])
                direct = await client.post(
                    f"{a}/responses", json={"model": SIM_MODEL, "input": "Hi"}
                )
                models = (await client.get(f"{b}/models")).json()["data"]
    assert texts == [direct.json()["output"][0]["content"][0]["text"]] * 3
    assert {"local", "local-alias", "gpt-5", "sim"} <= {m["id"] for m in models}
    assert upstream(registry, "local").counters.requests == 3


def run_serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_a_file_naming_a_builtin_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text('[models.sim]\nupstream = "http://127.0.0.1:9/v1"\n')
    done = run_serve("--models", "models.toml", "--port", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    builtin = ", ".join(default_registry().names())  # sim and its presets (and smollm2)
    assert done.stderr == (
        "rollout serve: models.toml: models.sim: `sim` is a built-in model, which stays "
        f"available; a models file cannot replace it: use another name (built-in: {builtin})\n"
    )
    assert not (tmp_path / "rollout-data").exists()


def test_an_unset_api_key_variable_is_a_warning_at_start(tmp_path: Path) -> None:
    """The warning comes before the server binds; a port in use then ends the run at once."""
    (tmp_path / "models.toml").write_text(
        '[models.hosted]\nupstream = "https://api.example.com/v1"\n'
        'api_key_env = "ROLLOUT_TEST_UNSET_KEY"\n'
        '[models.keyed]\nupstream = "https://api.example.com/v1"\napi_key_env = "HOME"\n'
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = run_serve("--models", "models.toml", "--port", port, cwd=tmp_path)
    assert done.returncode == 1
    warning, failure = done.stderr.splitlines()
    assert warning.endswith(
        " WARNING rollout.server: model `hosted`: api_key_env names ROLLOUT_TEST_UNSET_KEY, "
        "which is not set; its requests go to https://api.example.com/v1 without an API key"
    )
    assert failure.startswith("rollout serve: 127.0.0.1:")  # `keyed`'s variable is set
