"""`rollout conform`: command-line wiring (arguments, then `run`)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("conform", help="(not yet implemented)")


def run(args: argparse.Namespace) -> int:
    print("rollout conform: not yet implemented")
    return 2
