"""The model registry file (`rollout serve --models FILE`), TOML.

    [models.NAME]                 # the model name clients send
    upstream = "http://127.0.0.1:8080/v1"   # an OpenAI-compatible base URL (chat completions)
    model = "upstream-model-name"           # default: NAME
    api_key_env = "UPSTREAM_API_KEY"        # optional: environment variable with the key
    context_window = 131072                 # tokens; default 400000
    connect_timeout = 5.0                   # seconds
    read_timeout = 300.0                    # seconds of upstream silence before failing
    retries = 2                             # on connect errors and 5xx before the first token
    max_connections = 64                    # the connection pool's bound
    aliases = ["other-name"]
    description = "..."

    [aliases]
    "gpt-5" = "NAME"                        # any model string, `sim:...` included

The built-in `sim` models stay available alongside: a file that names one of them (as a model
or an alias) is refused, as is an alias that would hide a model of the file.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from rollout.protocol import RemoteProtocolError

from ._defaults import default_registry
from ._models import DEFAULT_CONTEXT_WINDOW, ModelRegistry, ModelSpec
from ._upstream import UpstreamBackend, UpstreamConfig

__all__ = ["ConfigError", "load_registry", "missing_api_keys", "registry_from_mapping"]

_UPSTREAM_KEYS = {
    "api_key_env": str,
    "connect_timeout": float,
    "read_timeout": float,
    "retries": int,
    "max_connections": int,
}


class ConfigError(ValueError):
    """The model registry file is invalid; the message names the file and the key."""


def load_registry(path: Path) -> ModelRegistry:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return registry_from_mapping(data, source=str(path))


# Numbers that must be positive (retries may be 0).
_POSITIVE = {"connect_timeout", "read_timeout", "max_connections", "context_window"}


def _get(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    if isinstance(value, int | float) and (value <= 0 if key in _POSITIVE else value < 0):
        bound = "> 0" if key in _POSITIVE else ">= 0"
        raise ConfigError(f"{where}.{key}: expected a number {bound}, got {value!r}")
    return value


def _table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table, got {value!r}")
    return value


def _not_builtin(name: str, where: str, builtin: list[str]) -> None:
    if name in builtin:
        raise ConfigError(
            f"{where}: `{name}` is a built-in model, which stays available; a models file "
            f"cannot replace it: use another name (built-in: {', '.join(builtin)})"
        )


def registry_from_mapping(data: dict[str, Any], *, source: str = "models") -> ModelRegistry:
    registry = default_registry()
    builtin = registry.names()
    known = {"models", "aliases"}
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{source}: unknown table [{key}] (expected [models.NAME], [aliases])"
            )
    for name, table in _table(data, "models", source).items():
        where = f"{source}: models.{name}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table")
        if ":" in name:  # `name:k=v` is how clients pass model parameters
            raise ConfigError(f"{where}: a model name can't contain ':'")
        _not_builtin(name, where, builtin)
        allowed = {"upstream", "model", "context_window", "aliases", "description", *_UPSTREAM_KEYS}
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key")
        if "upstream" not in table:
            raise ConfigError(f"{where}: `upstream` (the base URL) is required")
        base_url = _get(table, "upstream", str, where)
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{where}.upstream: expected an http:// or https:// URL, got {base_url!r}"
            )
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(
            isinstance(a, str) and ":" not in a for a in aliases
        ):
            raise ConfigError(
                f"{where}.aliases: expected an array of names (without ':'), got {aliases!r}"
            )
        options = {
            k: _get(table, k, kind, where) for k, kind in _UPSTREAM_KEYS.items() if k in table
        }
        backend = UpstreamBackend(
            UpstreamConfig(
                base_url=base_url,
                model=_get(table, "model", str, where) if "model" in table else name,
                **options,
            )
        )
        registry.add(
            ModelSpec(
                name=name,
                backend=backend,
                context_window=_get(table, "context_window", int, where)
                if "context_window" in table
                else DEFAULT_CONTEXT_WINDOW,
                description=_get(table, "description", str, where)
                if "description" in table
                else "",
            )
        )
        for alias in aliases:
            _not_builtin(alias, f"{where}.aliases", builtin)
            registry.alias(alias, name)
    alias_table = _table(data, "aliases", source)
    models = set(_table(data, "models", source))
    for alias, target in alias_table.items():
        if not isinstance(target, str):
            raise ConfigError(f"{source}: aliases.{alias}: expected a model string")
        _not_builtin(alias, f"{source}: aliases.{alias}", builtin)
        if alias in models:
            raise ConfigError(
                f"{source}: aliases.{alias}: `{alias}` is a model of this file; an alias of "
                "the same name would hide it: use another name"
            )
        registry.alias(alias, target)
    for alias, target in alias_table.items():  # after all: aliases may chain
        try:
            registry.resolve(alias)
        except RemoteProtocolError:
            raise ConfigError(
                f"{source}: aliases.{alias}: {target!r} is not a model of the registry"
            ) from None
    return registry


def missing_api_keys(registry: ModelRegistry) -> list[str]:
    """One warning per upstream model whose `api_key_env` names a variable that is unset or
    empty: its requests would go without a key (and the upstream would likely refuse them)."""
    warnings = []
    for spec in registry.specs():
        backend = spec.backend
        if not isinstance(backend, UpstreamBackend):
            continue
        variable = backend.config.api_key_env
        if variable and not os.environ.get(variable):
            warnings.append(
                f"model `{spec.name}`: api_key_env names {variable}, which is not set; its "
                f"requests go to {backend.config.base_url} without an API key"
            )
    return warnings
