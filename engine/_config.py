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
    tokenizer = "/path/to/tokenizer.json"   # optional: the model's own tokenizer (below)
    aliases = ["other-name"]
    description = "..."

    [models.NAME]                 # a GGUF model run in this process by llama.cpp
    gguf = "/path/to/model.gguf"            # (needs `pip install 'rollout-engine[llama]'`)
    threads = 2                             # CPU threads; default: all
    context_size = 8192                     # tokens per conversation; default: the model's
    kv_memory_mb = 2048                     # the KV pool, allocated on first use: as many
                                            # sequences of context_size tokens as it holds
                                            # (SmolLM2-135M: 22.5 KiB per token)
    sequences = 16                          # at most this many sequences (default 64)
    prefill_queue_tokens = 8192             # prompt tokens queued on the model before a new
                                            # turn waits (in arrival order) to be admitted
    chat_template = "{% for m in messages %}..."  # default: the GGUF's own
    aliases = ["other-name"]
    description = "..."

    [aliases]
    "gpt-5" = "NAME"                        # any model string, `sim:...` included

The built-in models (`sim` and its presets; `smollm2` with the llama extra) stay available
alongside: a file that names one of them (as a model or an alias) is refused, as is an alias
that would hide a model of the file.

Paths (`gguf`, `tokenizer`) are taken as written (`~` expanded): a relative one is relative to
the directory `rollout serve` runs in, not to the models file.

`tokenizer` (upstream models only; see `_model_tokenizer`) names the model's tokenizer, for
the usage an upstream does not report (llama-cpp-python's server reports none in a stream):

- a Hugging Face `tokenizer.json` (needs `pip install 'rollout-engine[tokenizers]'`; loaded
  with the file): the model's conversations render with rollout's chat template over this
  tokenizer, so the input tokens are the model's tokens of the conversation's text plus
  rollout's framing (a few control tokens per message, not the model's own template's);
- a GGUF file (needs `pip install 'rollout-engine[llama]'`; its header is checked with the
  file, its vocabulary loaded on the model's first use, without weights): conversations
  render with the model's own chat template and vocabulary, as the in-process models do
  (a template the renderer refuses falls back to rollout's, over the model's vocabulary).

Without usage from the upstream, a turn's input tokens are then that rendering's (the
context, as rollout's own models count it: without the generation prompt), and its output
tokens the tokenizer's count of the output text: each message's text and each function
call's name and arguments, each tokenized on its own (not the model's markup around a call,
nor its end-of-turn token). Such a count is not an estimate (`usage_estimated` stays); without
`tokenizer`, the output tokens are the stream's chunks, one each, counted in `usage_estimated`.
Usage the upstream reports is always taken as reported.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from rollout.protocol import RemoteProtocolError

from ._defaults import default_registry
from ._llama import DEFAULT_KV_INDEX_MB, LlamaBackend, LlamaConfig, llama_available
from ._model_tokenizer import TokenizerFileError, load_model_tokenizer
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


_GGUF_KEYS = {
    "threads": int,
    "context_size": int,
    "kv_memory_mb": float,
    "sequences": int,
    "prefill_queue_tokens": int,
    "chat_template": str,
}


class ConfigError(ValueError):
    """The model registry file is invalid; the message names the file and the key."""


def load_registry(path: Path, *, kv_cache_mb: float = DEFAULT_KV_INDEX_MB) -> ModelRegistry:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return registry_from_mapping(data, source=str(path), kv_cache_mb=kv_cache_mb)


# Numbers that must be positive (retries may be 0).
_POSITIVE = {
    "connect_timeout",
    "read_timeout",
    "max_connections",
    "context_window",
    "threads",
    "context_size",
    "kv_memory_mb",
    "sequences",
    "prefill_queue_tokens",
}


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


def registry_from_mapping(
    data: dict[str, Any], *, source: str = "models", kv_cache_mb: float = DEFAULT_KV_INDEX_MB
) -> ModelRegistry:
    registry = default_registry(kv_cache_mb=kv_cache_mb)
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
        if "gguf" in table:
            registry.add(_gguf_model(name, table, where, kv_cache_mb))
            _add_aliases(registry, name, table, where, builtin)
            continue
        allowed = {
            "upstream",
            "model",
            "context_window",
            "tokenizer",
            "aliases",
            "description",
            *_UPSTREAM_KEYS,
        }
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key")
        if "upstream" not in table:
            raise ConfigError(
                f"{where}: `upstream` (the base URL) or `gguf` (a model file) is required"
            )
        base_url = _get(table, "upstream", str, where)
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{where}.upstream: expected an http:// or https:// URL, got {base_url!r}"
            )
        options = {
            k: _get(table, k, kind, where) for k, kind in _UPSTREAM_KEYS.items() if k in table
        }
        tokenizer = None
        if "tokenizer" in table:
            path = Path(_get(table, "tokenizer", str, where)).expanduser()
            try:
                tokenizer = load_model_tokenizer(path)
            except TokenizerFileError as exc:
                raise ConfigError(f"{where}.tokenizer: {exc}") from None
        backend = UpstreamBackend(
            UpstreamConfig(
                base_url=base_url,
                model=_get(table, "model", str, where) if "model" in table else name,
                **options,
            ),
            count_tokens=tokenizer.count if tokenizer is not None else None,
        )
        registry.add(
            ModelSpec(
                name=name,
                backend=backend,
                renderer=tokenizer.renderer if tokenizer is not None else None,
                context_window=_get(table, "context_window", int, where)
                if "context_window" in table
                else DEFAULT_CONTEXT_WINDOW,
                description=_get(table, "description", str, where)
                if "description" in table
                else "",
            )
        )
        _add_aliases(registry, name, table, where, builtin)
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


def _add_aliases(
    registry: ModelRegistry, name: str, table: dict[str, Any], where: str, builtin: list[str]
) -> None:
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(
        isinstance(a, str) and ":" not in a for a in aliases
    ):
        raise ConfigError(
            f"{where}.aliases: expected an array of names (without ':'), got {aliases!r}"
        )
    for alias in aliases:
        _not_builtin(alias, f"{where}.aliases", builtin)
        registry.alias(alias, name)


def _gguf_model(name: str, table: dict[str, Any], where: str, kv_cache_mb: float) -> ModelSpec:
    """A `gguf = PATH` table: a model run in this process (its file is opened now, memory-
    mapped, to read its context size and chat template; its KV pool comes on first use)."""
    allowed = {"gguf", "aliases", "description", *_GGUF_KEYS}
    if "tokenizer" in table:
        raise ConfigError(
            f"{where}.tokenizer: only for upstream models (a `gguf` model counts with its own)"
        )
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key")
    missing = llama_available()
    if missing is not None:
        raise ConfigError(f"{where}.gguf: {missing}")
    path = Path(_get(table, "gguf", str, where)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{where}.gguf: no such file: {path}")
    options = {k: _get(table, k, kind, where) for k, kind in _GGUF_KEYS.items() if k in table}
    if "sequences" in options:
        options["slots"] = options.pop("sequences")
    backend = LlamaBackend(LlamaConfig(path=path, index_mb=kv_cache_mb, **options))
    try:
        context = backend.context_window
    except Exception as exc:  # a damaged file, a template that cannot serve: named here
        raise ConfigError(f"{where}.gguf: {path}: {exc}") from None
    return ModelSpec(
        name=name,
        backend=backend,
        renderer=backend.renderer,
        accepts_params=True,  # calls=N: a forced tool loop (LlamaBackend.check_params)
        context_window=context,
        description=_get(table, "description", str, where)
        if "description" in table
        else f"{path.name}, run by llama.cpp in this process",
        owned_by="rollout",
    )


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
