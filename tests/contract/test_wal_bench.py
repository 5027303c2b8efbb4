"""``bench/wal.py`` runs as its docstring shows, in a tiny configuration.

It starts its own PostgreSQL (``wal_level=logical``, removed afterwards) and
prints the five sections' tables; the figures themselves are not checked
(so it runs beside other tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_server

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "wal.py"
TINY = ("--events", "300", "--rate", "50", "--seconds", "2", "--rounds", "1")
HEADINGS = (
    "== 1. drain rate",
    "== 2. commit-to-broker latency",
    "== 3. write volume",
    "== 4. ceiling",
    "== 5. client choice",
)
ROWS = (
    "polling ordered (partitions)",
    "polling unordered",
    "WAL relay",
    "producing alone (the inserts)",
    "bare psycopg2 stream reader",
    "bare lease loop",
    "SQL peek + advance",
    "psycopg 3",
)


def test_the_docstring_shows_the_tiny_command() -> None:
    assert "python bench/wal.py " + " ".join(TINY) in BENCH.read_text()


def test_the_bench_runs_and_prints_every_table() -> None:
    try:
        subprocess.run(["pg_config", "--bindir"], capture_output=True, check=True)
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"PostgreSQL server binaries not found ({exc}); CI=true requires them")
        pytest.skip(f"PostgreSQL server binaries not found: {exc}")
    result = subprocess.run(
        [sys.executable, str(BENCH), *TINY],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for heading in HEADINGS:
        assert heading in out, out
    for row in ROWS:
        assert row in out, out
    assert "nan" not in out, out
