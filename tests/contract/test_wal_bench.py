"""``bench/wal.py`` runs as its docstring shows, in a tiny configuration.

It starts its own PostgreSQL (``wal_level=logical``, removed afterwards) and
prints the five sections' tables; the figures themselves are not checked
(so it runs beside other tests).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.bench_support import Bench, assert_printed

pytestmark = pytest.mark.needs_server

BENCH = Bench("wal", ("--events", "300", "--rate", "50", "--seconds", "2", "--rounds", "1"))
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
    assert BENCH.documented()


def test_the_bench_runs_and_prints_every_table() -> None:
    try:
        subprocess.run(["pg_config", "--bindir"], capture_output=True, check=True)
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"PostgreSQL server binaries not found ({exc}); CI=true requires them")
        pytest.skip(f"PostgreSQL server binaries not found: {exc}")
    out = BENCH.run(timeout=400)
    assert_printed(out, HEADINGS + ROWS)
