"""``bench/binlog.py`` runs as its docstring shows, in a tiny configuration.

It starts its own MariaDB with the binlog on (removed afterwards), relays to
RabbitMQ and prints the four sections' tables; the figures themselves are
not checked (so it runs beside other tests), only that each is a number.
"""

from __future__ import annotations

import re

import pytest

from tests.bench_support import Bench, assert_figures, assert_printed
from tests.contract.broker_fixtures import require_rabbitmq

pytestmark = pytest.mark.needs_server

BENCH = Bench("binlog", ("--events", "200", "--rate", "50", "--seconds", "1", "--rounds", "1"))
HEADINGS = (
    "== 1. drain rate to RabbitMQ",
    "== 2. commit-to-broker latency",
    "== 3. binlog bytes per event",
    "== 4. ceilings",
)
ROWS = (
    "polling ordered (partitions)",
    "polling unordered",
    "binlog relay",
    "polling (0.2-1 s)",
    "producing alone (the inserts)",
    "produce + binlog relay",
    "raw pika, confirms per batch",
    "bare binlog reader",
    "bare lease loop, PyMySQL",
)


def test_the_docstring_shows_the_tiny_command() -> None:
    assert BENCH.documented()


def test_the_bench_runs_and_prints_every_table() -> None:
    broker = require_rabbitmq()  # skips, or fails under CI=true, without RabbitMQ
    out = BENCH.run("--broker", broker, timeout=120)
    assert_printed(out, HEADINGS)
    assert_figures(out, ROWS)
    # The latency row: events, then p50 (below 0 where the relay saw an event before its
    # producer's commit returned: the binlog reaches a reader before the client's OK).
    assert re.search(r"binlog relay\s+\d+\s+-?\d+\.\d", out), out
