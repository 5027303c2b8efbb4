"""``bench/dashboard.py`` runs as its docstring shows, in a tiny configuration.

On PostgreSQL and MariaDB it fills a table, serves it with ``outbox dashboard``
and prints both parts (the overview's latency beside its ceilings, the drain
with and without a dashboard beside the bare lease loop). What the page
showed must match the table; the figures themselves are not checked (so it
runs beside other tests).
"""

from __future__ import annotations

import pytest

from tests.bench_support import Bench, assert_printed

pytestmark = pytest.mark.needs_server

BENCH = Bench("dashboard", (
    "--rows", "3000", "--requests", "3", "--events", "2000", "--drain-history", "3000",
    "--rounds", "1",
))  # fmt: skip
LINES = (
    "== 1. overview latency",
    "GET /healthz (no database)",
    "SELECT 1 (an engine of the same URL)",
    "GET /api/overview?range=7d",
    "GET /api/overview?since= (a refresh)",
    "flow(7d)",
    "== 2. drain with a dashboard refreshing",
    "ceiling, bare lease loop (median)",
    "relay + dashboard to the relay of the same round (median)",
    "/api/overview?range=1h during the drains",
)


def test_the_docstring_shows_the_tiny_command() -> None:
    assert BENCH.documented()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_the_bench_runs_and_the_page_matches_the_table(db_url: str) -> None:
    out = BENCH.run("--db", db_url, timeout=240)
    assert_printed(out, LINES)
    # pending, leased and dead as the table holds them; the chart's created and sent rows
    assert out.count("  ok\n") == 5, out
    assert "MISMATCH" not in out, out
