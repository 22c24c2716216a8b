"""The models file's `tokenizer` key: an upstream model's own tokenizer counts the usage the
upstream does not report (llama-cpp-python's server reports none in a stream).

Against a stand-in upstream that streams without usage, through a registry loaded from a
models-file mapping (the key's whole path: config, route renderer, backend):

- a tokenizer.json (a tiny one built here: one token per character, so counts are easy to
  state): the output tokens are its count of the output text (each message's text, each
  call's name and arguments), the input tokens its count of rollout's rendering, and
  `usage_estimated` does not move;
- the packaged SmolLM2 GGUF (skipped without the llama extra): the input tokens are the
  model's own chat template's rendering of the conversation (its Jinja template run here,
  tokenized with its vocabulary), the output tokens its vocabulary's count of the text; the
  file is not loaded until the model is used;
- without the key, as before: the chunks are counted, an estimate, in `usage_estimated`.

Mistakes in the key are `ConfigError`s naming the file and the key.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import string
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rollout.engine._config import ConfigError, registry_from_mapping
from rollout.engine._model_tokenizer import GgufRenderer, gguf_keys
from rollout.engine._render import ChatTemplateRenderer
from rollout.engine._tokenizer import O200kTokenizer

from tests.client_harness import unavailable
from tests.llama_harness import require_llama
from tests.test_upstream_servers import TOOL
from tests.upstream_harness import Exchange, chunk, open_fake_upstream, open_rollout

DEADLINE = 60.0
ESTIMATED = 'rollout_work_total{counter="usage_estimated"} '
ARGUMENTS = '{"command": "ls"}'


def require_tokenizers() -> None:
    if importlib.util.find_spec("tokenizers") is None:
        unavailable("Hugging Face tokenizers is not installed (pip install -e '.[test]')")


def char_tokenizer(directory: Path) -> Path:
    """A tokenizer.json of one token per character (printable ASCII, else `[UNK]`, one too)."""
    require_tokenizers()
    from tokenizers import Regex, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    vocab = {"[UNK]": 0} | {c: i + 1 for i, c in enumerate(string.printable)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Split(Regex(r"[\s\S]"), behavior="isolated")
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    # The oracle: the library's own count, one per character.
    for text in ("One two three.", ARGUMENTS, "naïve"):
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == len(text)
    return path


def quiet(chunks: list[dict[str, Any]]) -> Any:
    """An upstream answering every request with `chunks` (no usage chunk: as llama-cpp-python
    streams)."""

    async def handler(exchange: Exchange) -> None:
        await exchange.stream(chunks)

    return handler


TEXT = [chunk(content=piece) for piece in ("One ", "two ", "three.")] + [chunk(finish="stop")]
CALL = {"index": 0, "id": "call_0", "type": "function"}
TEXT_THEN_CALL = [
    chunk(content="Sure."),
    chunk(tool_calls=[{**CALL, "function": {"name": "run", "arguments": ARGUMENTS[:7]}}]),
    chunk(tool_calls=[{"index": 0, "function": {"arguments": ARGUMENTS[7:]}}]),
    chunk(finish="tool_calls"),
]


async def usage_and_estimated(
    table: dict[str, Any], chunks: list[dict[str, Any]], **body: Any
) -> tuple[dict[str, Any], float]:
    """One response from model `m` (its models-file table pointed at a quiet stand-in
    upstream): its usage, and the `usage_estimated` counter after it."""
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(quiet(chunks)) as (up, _):
            table = {"upstream": up, "retries": 0, **table}
            registry = registry_from_mapping({"models": {"m": table}}, source="models.toml")
            async with open_rollout(registry=registry) as url, httpx.AsyncClient() as client:
                request = {"model": "m", "input": "Count.", **body}
                response = (await client.post(f"{url}/responses", json=request)).json()
                metrics = (await client.get(url.removesuffix("/v1") + "/metrics")).text
    assert response["status"] == "completed", response
    (value,) = [r.removeprefix(ESTIMATED) for r in metrics.splitlines() if r.startswith(ESTIMATED)]
    return response["usage"], float(value)


# --- a tokenizer.json --------------------------------------------------------------------------


async def test_a_tokenizer_json_counts_the_output_text_and_the_input(tmp_path: Path) -> None:
    path = char_tokenizer(tmp_path)
    usage, estimated = await usage_and_estimated({"tokenizer": str(path)}, TEXT)
    assert usage["output_tokens"] == len("One two three.")  # not 3 chunks, nor o200k's 4
    # rollout's template, its control tokens one each, the text in the model's tokens:
    # <|start|> "user" <|message|> "Count." <|end|>
    assert usage["input_tokens"] == 3 + len("user") + len("Count.")
    assert estimated == 0


async def test_a_tokenizer_json_counts_a_calls_name_and_arguments(tmp_path: Path) -> None:
    path = char_tokenizer(tmp_path)
    usage, estimated = await usage_and_estimated(
        {"tokenizer": str(path)}, TEXT_THEN_CALL, tools=[TOOL]
    )
    assert usage["output_tokens"] == len("Sure.") + len("run") + len(ARGUMENTS)
    assert estimated == 0


async def test_without_a_tokenizer_the_chunks_are_counted_as_an_estimate() -> None:
    usage, estimated = await usage_and_estimated({}, TEXT)
    assert usage["output_tokens"] == 3  # a chunk each
    assert estimated == 1


async def test_usage_the_upstream_reports_is_taken_as_reported(tmp_path: Path) -> None:
    path = char_tokenizer(tmp_path)
    reported = {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    usage, estimated = await usage_and_estimated(
        {"tokenizer": str(path)}, [*TEXT, chunk(usage=reported)]
    )
    assert (usage["input_tokens"], usage["output_tokens"]) == (40, 7)
    assert estimated == 0


# --- a GGUF ------------------------------------------------------------------------------------


def smollm2_path() -> Path:
    require_llama()
    from rollout.engine._llama_vocab import packaged_smollm2

    path = packaged_smollm2()
    assert path is not None
    return path


def test_a_gguf_is_not_loaded_with_the_models_file() -> None:
    path = smollm2_path()
    registry = registry_from_mapping(
        {"models": {"m": {"upstream": "http://127.0.0.1:9/v1", "tokenizer": str(path)}}}
    )
    (spec,) = [s for s in registry.specs() if s.name == "m"]
    assert isinstance(spec.renderer, GgufRenderer)
    assert spec.renderer._renderer is None  # listed, not loaded
    assert {"tokenizer.ggml.model", "tokenizer.chat_template"} <= gguf_keys(path)


GERMAN = "Überprüfung der Straßenbahn-Fahrpläne"  # SmolLM2: 20 tokens; o200k: 9
GERMAN_PIECES = ["Überprüfung", " der", " Straßenbahn-Fahrpläne"]


async def test_a_gguf_counts_with_the_models_own_template_and_vocabulary() -> None:
    path = smollm2_path()
    import jinja2
    from rollout.engine._llama_vocab import LlamaVocab

    with LlamaVocab.open(path) as vocab:
        assert vocab.chat_template is not None
        # The conversation as the upstream renders it with the GGUF's template (as Hugging
        # Face's apply_chat_template does), without the generation prompt (rollout's models
        # count the context without it).
        prompt = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
            vocab.chat_template
        )
        text = prompt.render(
            messages=[{"role": "user", "content": "Count."}], add_generation_prompt=False
        )
        expected_input = len(vocab.encode_special(text)) + (1 if vocab.add_bos else 0)
        expected_output = len(vocab.encode(GERMAN))
    assert "".join(GERMAN_PIECES) == GERMAN
    chunks = [chunk(content=piece) for piece in GERMAN_PIECES] + [chunk(finish="stop")]
    usage, estimated = await usage_and_estimated({"tokenizer": str(path)}, chunks)
    assert expected_input > 20  # SmolLM2's default system turn is in it
    # Neither the chunks nor o200k's count (the estimates this replaces) would pass.
    assert expected_output not in (len(GERMAN_PIECES), len(O200kTokenizer().encode(GERMAN)))
    assert usage["input_tokens"] == expected_input
    assert usage["output_tokens"] == expected_output
    assert estimated == 0


def test_a_template_the_renderer_refuses_falls_back_to_rollouts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's tokens still count; rollout's template frames them (logged)."""
    path = smollm2_path()
    import rollout.engine._template as template

    def refuse(*args: Any) -> None:
        raise ValueError("the template rewrites earlier turns")

    monkeypatch.setattr(template, "TemplateRenderer", refuse)
    with caplog.at_level(logging.WARNING, logger="rollout.engine.tokenizer"):
        loaded = GgufRenderer(path).loaded()
    assert isinstance(loaded, ChatTemplateRenderer)
    assert loaded.tokenizer.name.startswith("llama:")
    assert "rewrites earlier turns" in caplog.text and str(path) in caplog.text


# --- mistakes ----------------------------------------------------------------------------------

UP = {"upstream": "http://127.0.0.1:9/v1"}


def gguf_bytes(metadata: dict[str, str], *, version: int = 3) -> bytes:
    """A GGUF header of string metadata and no tensors."""

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(metadata))
    for key, value in metadata.items():
        out += text(key) + struct.pack("<I", 8) + text(value)
    return out


def config_error(table: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        registry_from_mapping({"models": {"m": table}}, source="models.toml")
    return str(info.value)


def test_a_missing_file_is_refused_naming_the_key() -> None:
    message = config_error({**UP, "tokenizer": "/nonexistent/tokenizer.json"})
    assert message == "models.toml: models.m.tokenizer: no such file: /nonexistent/tokenizer.json"


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("tokenizer.json", b"not a tokenizer", "not a Hugging Face tokenizer.json"),
        ("tokenizer.json", json.dumps({"version": "1.0"}).encode(), "not a Hugging Face"),
        ("tokenizer.json", b"\xff\xfe binary", "not a Hugging Face tokenizer.json"),
        ("tokenizer.json", b"", "not a Hugging Face tokenizer.json"),
        ("model.gguf", b"not a gguf file at all", "not a GGUF file"),
        ("model.gguf", b"GGUF\x03\x00\x00\x00\x00", "not a GGUF file"),  # truncated
        ("model.gguf", gguf_bytes({"general.name": "x"}, version=1), "not a GGUF file"),
        ("model.bin", gguf_bytes({"general.name": "x"}), "a GGUF file without a tokenizer"),
    ],
)
def test_a_file_that_is_not_a_tokenizer_is_refused_at_load(
    tmp_path: Path, name: str, data: bytes, says: str
) -> None:
    if name.endswith(".json"):
        require_tokenizers()
    path = tmp_path / name
    path.write_bytes(data)
    message = config_error({**UP, "tokenizer": str(path)})
    assert message.startswith(f"models.toml: models.m.tokenizer: {path}: {says}"), message


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    message = config_error({**UP, "tokenizer": str(tmp_path)})  # a directory
    assert message.startswith(f"models.toml: models.m.tokenizer: {tmp_path}: "), message
    if os.geteuid() != 0:  # root reads anything
        path = tmp_path / "tokenizer.json"
        path.write_text("{}")
        path.chmod(0)
        message = config_error({**UP, "tokenizer": str(path)})
        assert message == f"models.toml: models.m.tokenizer: {path}: Permission denied"


def test_the_key_is_for_upstream_models_only() -> None:
    message = config_error({"gguf": "/some/model.gguf", "tokenizer": "/t.json"})
    assert "models.m.tokenizer: only for upstream models" in message
    assert "models.m.tokenizer: expected str" in config_error({**UP, "tokenizer": 5})
