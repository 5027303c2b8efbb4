"""The log-tailing relay's parts that need no server: lanes and the watermark, the
registry, the log source interface as PostgreSQL implements it, the publish rate.

The relay itself, on a real PostgreSQL, is tests/contract/test_wal_relay.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox_core import Outbox
from outbox_core.dialects.postgresql.wal import LogicalReplication, SlotSource, StreamStart
from outbox_core.dialects.postgresql.wal.names import wal_distance
from outbox_core.dialects.postgresql.wal.source import log_start
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event
from outbox_core.relay.tailing import (
    LogSource,
    LogTailing,
    SourceInUse,
    log_tailing,
)
from outbox_core.relay.tailing.lanes import Lanes, lane_of
from outbox_core.relay.tailing.reports import PublishRate

PG = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"


def event(n: int, key: str | None) -> Event:
    return Event(n, f"e{n}", "t", key, {}, {}, 1, datetime(2024, 1, 1, tzinfo=UTC), "")


def test_the_watermark_passes_a_transaction_only_once_it_and_every_earlier_one_is_done() -> None:
    lanes = Lanes()
    first, second, third = lanes.begin(10), lanes.begin(20), lanes.begin(30)
    lanes.add(first, event(1, "a"), "a", 0.0)
    lanes.add(second, event(2, "a"), "a", 0.0)
    lanes.add(second, event(3, "b"), "b", 0.0)
    assert lanes.held == 3 and not lanes.idle
    # Each lane's run from its head, in stream order; a key's second event after its first.
    assert [i.event.id for i in lanes.due(1.0, 10)] == [1, 2, 3]
    [a1, a2, b] = lanes.due(1.0, 10)
    lanes.done(b)
    assert lanes.watermark() is None  # the first transaction is not done
    lanes.done(a1)
    assert lanes.watermark() == 10
    lanes.done(a2)
    # The third (eventless) transaction is done as soon as the second is.
    assert lanes.watermark() == 30 and lanes.idle and lanes.held == 0
    assert third.open == 0


def test_a_lane_taken_for_the_table_or_dead_is_done_for_its_transactions() -> None:
    lanes = Lanes()
    txn = lanes.begin(5)
    for n in range(3):
        lanes.add(txn, event(n, "k"), "k", float(n))
    lanes.add(txn, event(9, None), lane_of(event(9, None)), 0.0)
    assert lanes.next_due() == 0.0
    assert [i.event.id for i in lanes.due(0.5, 10)] == [0, 9]  # k's second is not due yet
    taken = lanes.take("k")
    assert [i.event.id for i in taken] == [0, 1, 2] and "k" not in lanes
    [keyless] = lanes.due(0.0, 10)
    lanes.drop(keyless)
    assert lanes.held == 0 and lanes.watermark() == 5


def test_the_registry_finds_a_dialects_log_tailing_by_its_package() -> None:
    postgres = Outbox(PG)
    try:
        found = log_tailing(postgres.dialect)
        assert isinstance(found, LogicalReplication)
        tailing: LogTailing = found  # the protocol, checked by mypy
        assert tailing.names(postgres.settings) == ("outbox_outbox", "outbox_outbox")
    finally:
        postgres.dispose()
    sqlite = Outbox("sqlite://")
    try:
        # No wal module beside the SQLite dialect: refused, pointing at polling.
        with pytest.raises(UnsupportedDatabase, match="--source table"):
            log_tailing(sqlite.dialect)
    finally:
        sqlite.dispose()


def test_postgresql_is_a_log_source_with_its_own_positions() -> None:
    outbox = Outbox(PG)
    try:
        source: LogSource = SlotSource(
            outbox.url,
            outbox.dialect,
            slot="outbox_outbox",
            publication="outbox_outbox",
            tables=[("public", "outbox")],
            relay="r",
        )
        assert source.name == "outbox_outbox"
        assert source.describe((0x16 << 32) | 0xB374D848) == "16/B374D848"
        assert source.distance(3 << 20, 1 << 20) == wal_distance(2 << 20) == "2.0 MiB"
    finally:
        outbox.dispose()
    told = StreamStart("s", system_id="7", timeline=2, flush_lsn=30, slot_lsn=10)
    start = log_start(told)
    assert (start.source, start.end, start.confirmed) == ("s", 30, 10)
    assert start.history != log_start(StreamStart("s", "7", 3, 30, 10)).history
    assert start.history != log_start(StreamStart("s", "8", 2, 30, 10)).history
    from outbox_core.dialects.postgresql.wal import SlotInUse

    assert issubclass(SlotInUse, SourceInUse)


def test_the_publish_rate_counts_since_the_start_within_the_first_minute() -> None:
    rate = PublishRate()
    assert rate.last_minute(0) == 0
    assert rate.last_minute(42) == 42
