"""Identifiers in the OpenAI style: a type prefix and random hex."""

from __future__ import annotations

import os

__all__ = ["new_id"]


def new_id(prefix: str, nbytes: int = 24) -> str:
    return f"{prefix}_{os.urandom(nbytes).hex()}"
