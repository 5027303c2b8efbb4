"""``bench/many_outboxes.py`` runs as its docstring shows, in a tiny configuration.

On PostgreSQL it creates a database of its own (dropped at the end) and
prints the three tables: the idle cost of a FleetRelay beside single relays
and a bare ``SELECT 1`` loop, the drain beside the bare lease loop and
redis-py, and a quiet tenant's latency beside a bare ``LISTEN``. The figures
themselves are not checked (so it runs beside other tests), only that each
row was measured and that the bench left nothing behind.
"""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from tests.bench_support import Bench, assert_printed
from tests.contract.stream_fixtures import require_redis

pytestmark = pytest.mark.needs_server

BENCH = Bench("many_outboxes", (
    "--outboxes", "4", "--singles", "2", "--warmup", "0.5", "--idle-seconds", "1",
    "--events", "400", "--spread", "2", "--rounds", "1", "--due-after", "3",
    "--backlog", "1000", "--rate", "20", "--quiet-seconds", "0.5",
))  # fmt: skip
ROWS = (
    "== 1. idle cost over 4 quiet outboxes",
    "bare SELECT 1 every 0.2s",
    "FleetRelay over 4, notify on",
    "FleetRelay over 4, notify off",
    "2 single relays x2, notify on",
    "2 single relays x2, notify off",
    "== 2. drain: 400 events",
    "ceiling: bare lease loop",
    "fleet, 2 outboxes -> accept",
    "fleet / single relay (accept)",
    "ceiling: redis-py pipelined XADD",
    "fleet / single relay (redis)",
    "== 3. fresh events at 20/s in a quiet tenant",
    "quiet tenant, another draining 1000",
)


def test_the_docstring_shows_the_tiny_command() -> None:
    assert BENCH.documented()


def test_the_bench_runs_and_prints_every_table(pg_url: str) -> None:
    redis_url = require_redis()
    prefix = "h6_bench_smoke"
    out = BENCH.run("--db", pg_url, "--redis", redis_url, "--prefix", prefix, timeout=240)
    assert_printed(out, ROWS)
    # Every idle row was counted on the server and in the client.
    idle = out.split("== 1.")[1].split("== 2.")[0]
    measured = [line for line in idle.splitlines() if "every 0.2s" in line or " x2," in line]
    measured += [line for line in idle.splitlines() if line.startswith("FleetRelay")]
    assert len(measured) == 5, idle
    for line in measured:
        server, client_tx = re.split(r"\s{2,}", line.strip())[1:3]
        assert float(server) > 0 and float(client_tx) > 0, line
    # The fleet drained every event (or the bench would have exited non-zero), and
    # the bench's own database is gone.
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            left = conn.execute(
                sa.text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                {"p": prefix + "%"},
            ).all()
    finally:
        engine.dispose()
    assert not left, left
