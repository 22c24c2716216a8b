"""rollout: an OpenAI-Responses-compatible engine that serves agent rollouts over a persistent
WebSocket.

One import root (the `rollout-engine` distribution):

| package            | what it is                                                          |
|--------------------|---------------------------------------------------------------------|
| `rollout.protocol` | the wire: sans-IO types, codecs, the event builder (no I/O, no clock) |
| `rollout.engine`   | the engine and its server (`open_engine`, `open_server`)             |
| `rollout.spec`     | the conformance checks (`rollout conform`, `run_conformance`)        |
| `rollout.bench`    | the benchmark (`rollout bench`, `run_benchmark`)                     |

`rollout._cli` is the `rollout` command; it imports the others, never the reverse.
"""

from .protocol import __version__

__all__ = ["__version__"]
