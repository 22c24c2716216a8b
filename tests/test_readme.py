"""The README's embedded-API example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_embedded_example_runs(tmp_path: Path) -> None:
    blocks = [b for b in python_blocks() if "open_engine" in b]
    assert blocks, "README lost its embedded-API example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stdout


def test_set_up_commands_are_the_two_documented() -> None:
    text = README.read_text()
    commands = re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
    assert commands[0].strip().endswith("rollout serve")
    assert commands[1].strip().endswith("pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = commands[1].strip().split("&& ", 2)[-1]
    assert test_command in ci
