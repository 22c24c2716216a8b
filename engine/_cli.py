"""The `rollout` command line: `serve`, `conform`, `bench`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout",
        description=(
            "An OpenAI-Responses-compatible engine for agent rollouts over a persistent "
            "WebSocket: serve it, test a server's conformance, or benchmark the agent loop."
        ),
    )
    parser.add_argument("--version", action="version", version=f"rollout {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
