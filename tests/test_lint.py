"""The linters as tests: `ruff check .` and `mypy` (its configuration, including the list of
packages, is in pyproject.toml), run from the repository root with the venv's executables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["mypy"]],
    ids=["ruff", "mypy"],
)
def test_linter_passes(command: list[str]) -> None:
    executable = BIN / command[0]
    assert executable.exists(), f"{command[0]} is not installed next to {sys.executable}"
    result = subprocess.run(
        [str(executable), *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"`{' '.join(command)}` exited with {result.returncode}:\n{result.stdout}{result.stderr}"
    )
