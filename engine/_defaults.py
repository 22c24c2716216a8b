"""The embedded defaults: the built-in simulated models."""

from __future__ import annotations

from ._models import ModelRegistry, ModelSpec
from ._sim import SimBackend

__all__ = ["SIM_ALIASES", "default_registry"]

# Named presets of the simulated model, listed by GET /v1/models.
SIM_ALIASES = {
    "sim-65": "sim:tps=65,ttft_ms=500",
    "sim-1000": "sim:tps=1000,ttft_ms=200",
    "sim-4000": "sim:tps=4000,ttft_ms=100",
}


def default_registry() -> ModelRegistry:
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
    return registry
