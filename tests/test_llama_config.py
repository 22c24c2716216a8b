"""The llama extra's configuration and plumbing: the built-in `smollm2`, `gguf` tables of the
models file (the docs' example, docs/serving.md), the `calls=N` parameter, `--kv-cache-mb`,
the KV metrics, and the model's own spelling of what it generated.

Tests that need llama-cpp-python and the packaged model skip without the extra (and fail
under `ROLLOUT_REQUIRE_ALL`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import httpx
import pytest
import trio
from rollout.engine._config import ConfigError, registry_from_mapping
from rollout.engine._defaults import SMOLLM2, SMOLLM2_CONTEXT, default_registry
from rollout.engine._llama import LlamaBackend
from rollout.protocol import RemoteProtocolError

from tests.llama_harness import require_llama, smollm2_renderer, smollm2_vocab
from tests.server_harness import open_test_server, parse_metrics
from tests.test_models_config import readme_toml

DEADLINE = 120


def packaged() -> Path:
    require_llama()
    from rollout.engine._llama_vocab import packaged_smollm2

    path = packaged_smollm2()
    assert path is not None
    return path


def test_smollm2_is_built_in_with_the_models_own_context() -> None:
    packaged()
    registry = default_registry()
    route = registry.resolve(SMOLLM2)
    assert isinstance(route.backend, LlamaBackend)
    assert route.context_window == SMOLLM2_CONTEXT == smollm2_vocab().context_length
    assert route.renderer is not None and route.render_version is not None
    assert route.render_version.startswith("jinja:")


def test_listing_the_built_in_models_does_not_load_smollm2() -> None:
    packaged()
    spec = next(s for s in default_registry().specs() if s.name == SMOLLM2)
    backend = spec.backend
    assert isinstance(backend, LlamaBackend)
    assert backend._model is None and backend.kv is None  # nothing loaded, nothing allocated


def test_the_readme_example_of_gguf_files_parses() -> None:
    path = packaged()
    text = readme_toml("gguf")
    data = tomllib.loads(text)
    (name, table), *_ = data["models"].items()
    table["gguf"] = str(path)  # the docs' path is an example: the packaged file here
    registry = registry_from_mapping(data, source="docs/serving.md")
    route = registry.resolve(name)
    backend = route.backend
    assert isinstance(backend, LlamaBackend)
    config = backend.config
    assert (config.threads, config.context_size, config.kv_memory_mb, config.slots) == (
        table["threads"],
        table["context_size"],
        table["kv_memory_mb"],
        table["sequences"],
    )
    # The context is the model's own (8k) when the table asks for more.
    assert route.context_window == min(table["context_size"], SMOLLM2_CONTEXT)
    per_sequence = SMOLLM2_CONTEXT * 23_040  # bytes: the model's context of f16 K and V
    held = int(table["kv_memory_mb"] * 2**20) // per_sequence
    assert backend.sequences == min(table["sequences"], held)
    assert backend.kv_cells == backend.sequences * SMOLLM2_CONTEXT


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"gguf": "/nonexistent/model.gguf"}, "models.m.gguf: no such file"),
        ({"gguf": "PATH", "threads": 0}, "models.m.threads: expected a number > 0"),
        ({"gguf": "PATH", "kv_memory_mb": "big"}, "models.m.kv_memory_mb: expected float"),
        ({"gguf": "PATH", "upstream": "http://x/v1"}, "models.m.upstream: unknown key"),
    ],
)
def test_gguf_mistakes_name_the_key(table: dict[str, object], message: str) -> None:
    path = packaged()
    table = {k: (str(path) if v == "PATH" else v) for k, v in table.items()}
    with pytest.raises(ConfigError) as info:
        registry_from_mapping({"models": {"m": table}}, source="models.toml")
    assert message in str(info.value)


def test_a_file_that_is_not_a_model_is_refused_at_load(tmp_path: Path) -> None:
    packaged()
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError) as info:
        registry_from_mapping({"models": {"m": {"gguf": str(bogus)}}}, source="models.toml")
    assert "models.m.gguf" in str(info.value) and "bogus.gguf" in str(info.value)


def test_the_calls_parameter_is_checked_when_routed() -> None:
    packaged()
    registry = default_registry()
    backend = registry.resolve("smollm2").backend
    assert isinstance(backend, LlamaBackend)
    backend.check_params({"calls": "3"})
    for params in ({"calls": "x"}, {"calls": "-1"}, {"tps": "4"}):
        with pytest.raises(RemoteProtocolError) as info:
            backend.check_params(params)
        assert info.value.body.param == "model"


def test_the_models_spelling_of_its_turn_is_kept() -> None:
    """A turn the model spelled otherwise than the tokenizer would renders as the model
    spelled it (so its KV matches), for whoever sends that text again."""
    renderer = smollm2_renderer()
    vocab = smollm2_vocab()
    from rollout.protocol import Message, OutputText

    text = "get_weather is here"
    canonical = vocab.encode(text)
    # The same text, one byte-level token at a time where the tokenizer merges.
    spelled = [t for piece in ("g", "et", "_weather is here") for t in vocab.encode(piece)]
    assert vocab.decode(spelled) == text and spelled != canonical
    item = Message(role="assistant", content=[OutputText(text=text)])
    before = list(renderer.render_item(item))
    assert renderer.remember_spelling(text, spelled)
    after = list(renderer.render_item(item))
    prompt = list(renderer.generation_prompt)
    assert after[: len(prompt)] == prompt
    assert after[len(prompt) : len(prompt) + len(spelled)] == spelled
    assert after[len(prompt) + len(spelled) :] == before[len(prompt) + len(canonical) :]
    # The tokenizer's own spelling needs no memory; another text's spelling is refused.
    assert not renderer.remember_spelling("plain words", vocab.encode("plain words"))
    assert not renderer.remember_spelling("other text", spelled)


async def test_kv_metrics_and_the_kv_cache_option(tmp_path: Path) -> None:
    packaged()
    body = {"model": "smollm2", "input": "Say hi.", "temperature": 0, "max_output_tokens": 8}
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, kv_cache_mb=3) as url:
            async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as http:
                for _ in range(2):  # the second finds the first's prefix in the index
                    resp = await http.post("/responses", json=body)
                    assert resp.status_code == 200 and resp.json()["status"] != "failed"
                metrics = parse_metrics((await http.get(url.removesuffix("/v1") + "/metrics")).text)
    labels = {"model": "smollm2"}

    def value(name: str, **more: str) -> float:
        return metrics[(name, frozenset({**labels, **more}.items()))]

    assert value("rollout_kv_cache_lookups_total", outcome="hit") == 1
    assert value("rollout_kv_cache_lookups_total", outcome="miss") == 1
    assert value("rollout_kv_cache_tokens_reused_total") > 0
    assert value("rollout_kv_cache_tokens", state="running") == 0
    assert 0 < value("rollout_kv_cache_tokens", state="indexed") <= 3 * 2**20 // 23_040
    # The default pool: as many sequences of 8,192 tokens as 2,048 MB holds (11).
    assert value("rollout_kv_cache_bytes") == 11 * 8192 * 23_040


async def test_under_tool_choice_none_the_model_answers_instead_of_writing_a_call(
    tmp_path: Path,
) -> None:
    """SmolLM2, taught the call envelope by the system turn, writes one as its answer after a
    tool output in words, even under `tool_choice: none` (and `calls=N`'s answer, which is
    "none"): a message whose text is a call nobody runs. The model's thread bans the tokens
    that would open the envelope while the output is blank, so it answers in words. With
    `--kv-cache-mb 0` every request evaluates its whole context alike (the same logits), so
    `auto` shows what the model would write first."""
    packaged()
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 22 C in Paris"},
    ]
    body = {"input": history, "tools": tools, "temperature": 0, "max_output_tokens": 48}
    outputs = {}
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, kv_cache_mb=0) as url:
            async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as http:
                for model, choice in (
                    ("smollm2", "auto"),
                    ("smollm2", "none"),
                    ("smollm2:calls=1", "auto"),
                ):
                    resp = await http.post(
                        "/responses", json={**body, "model": model, "tool_choice": choice}
                    )
                    assert resp.status_code == 200, resp.text
                    outputs[model, choice] = resp.json()["output"]
    # Free to choose, the model calls the tool again: a call is what it would write first.
    assert [o["type"] for o in outputs["smollm2", "auto"]] == ["function_call"]
    for key in (("smollm2", "none"), ("smollm2:calls=1", "auto")):
        (message,) = outputs[key]
        assert message["type"] == "message", key
        text = message["content"][0]["text"]
        assert text.strip() and "<tool" not in text, (key, text)
        assert "sunny" in text.lower(), (key, text)  # the tool's output, read
