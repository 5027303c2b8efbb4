"""A bench script run as its docstring shows, in a tiny configuration, and its tables read.

Each ``tests/contract/test_*_bench.py`` names its script and the tiny command
line its docstring shows (:class:`Bench`), runs it, and checks that what it
printed holds every table: the figures themselves are not checked, so the
benches run beside other tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    """``bench/<name>.py`` and the tiny arguments its docstring shows."""

    name: str
    tiny: tuple[str, ...]

    @property
    def path(self) -> Path:
        return ROOT / "bench" / f"{self.name}.py"

    def documented(self) -> bool:
        """The docstring shows ``python bench/<name>.py <tiny>``."""
        return f"python bench/{self.name}.py " + " ".join(self.tiny) in self.path.read_text()

    def run(self, *args: str, timeout: float) -> str:
        """What the script printed, run tiny with ``args`` from the repository's root; it
        must exit 0."""
        result = subprocess.run(
            [sys.executable, str(self.path), *args, *self.tiny],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout


def assert_printed(out: str, lines: Iterable[str]) -> None:
    """Each of ``lines`` is in ``out``, and no figure is ``nan`` (a section measured nothing)."""
    for line in lines:
        assert line in out, (line, out)
    assert not re.search(r"\bnan\b", out), out


def assert_figures(out: str, rows: Iterable[str]) -> None:
    """A line of ``out`` starts with each of ``rows``, a figure beside it."""
    lines = out.splitlines()
    for row in rows:
        line = next((x for x in lines if x.startswith(row)), None)
        assert line is not None, (row, out)
        assert re.search(r"\d", line[len(row) :]), line
