"""rollout's engine: pipeline stages, caches, the rollout coroutine, backends, stores, server."""

__version__ = "0.1.0"

__all__ = ["__version__"]
