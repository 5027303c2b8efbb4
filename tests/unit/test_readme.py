"""The README's two set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README must open with a shell block of set-up commands"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_exactly_two_commands_that_ci_runs() -> None:
    commands = readme_setup_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    # CI runs them verbatim, except for pip's -q.
    ci_lines = [line.replace("pip install -q ", "pip install ") for line in ci.splitlines()]
    for command in commands:
        assert command in ci_lines, f"CI does not run the README command: {command}"
    assert "outbox demo" in commands[0]
    assert "pytest" in commands[1]
