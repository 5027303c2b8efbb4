"""The binlog relay's per-event decisions, on a private MariaDB whose binlog is on.

The log-tailing relay is one relay whatever log it reads, so the PostgreSQL
module's tests of what it does with each event run here again, unchanged,
on the binlog (``feed`` is this module's: an outbox with its progress table
on the test's own MariaDB, a relay on a thread of this process):

* a retry holds only its key, and past ``max_attempts`` the event is dead;
* a database error other than a lost connection reconnects, losing nothing;
* replayed rows the log shows before other sessions see them are waited for;
* a rejected event is dead in the table with its key's later events held dead
  behind it, and ``outbox replay --key`` brings them back through the binlog
  in their order;
* ``block_on_dead=False`` lets the key move on;
* a delayed event waits and holds its key; a dead key holds its long-delayed
  events dead too;
* a long backoff hands the key to the table and the next relay finishes it in
  order, even when the previous relay's clock was ahead.

Beside them: python-mysql-replication failing mid-stream with an error of its
own reconnects and loses nothing; ``outbox status --source binlog --json`` and the relay's
``/metrics`` while an event is held (the source's lag and binlog kept, the
held and dead gauges, ``/healthz``), and after the relay stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.dialects.mysql.binlog.stream import BinlogStream
from tests.binlog_support import BinlogMariaDB
from tests.contract import test_wal_relay as wal
from tests.contract.test_wal_relay import (
    Feed,
    gauge,
    installed_feed,
    run,
    scrape,
    wait_for,
    watched_relay,
)

pytestmark = pytest.mark.needs_server


@pytest.fixture
def feed(binlog_server: BinlogMariaDB) -> Iterator[Feed]:
    # Feed's server field is the MariaDB here: the tests use its url only.
    with installed_feed(Feed, binlog_server, "blr") as made:  # type: ignore[arg-type]
        yield made


test_retry_holds_only_its_key_and_past_max_attempts_it_is_dead = (
    wal.test_retry_holds_only_its_key_and_past_max_attempts_it_is_dead
)
test_a_database_error_of_another_kind_reconnects_and_loses_nothing = (
    wal.test_a_database_error_of_another_kind_reconnects_and_loses_nothing
)
test_reject_marks_the_row_dead_and_replay_brings_it_back_through_the_stream = (
    wal.test_reject_marks_the_row_dead_and_replay_brings_it_back_through_the_stream
)
test_a_replay_the_log_shows_before_other_sessions_see_it_is_read_once_they_do = (
    wal.test_a_replay_the_log_shows_before_other_sessions_see_it_is_read_once_they_do
)
test_skip_dead_lets_the_key_move_on = wal.test_skip_dead_lets_the_key_move_on
test_a_delayed_event_waits_and_holds_its_key = wal.test_a_delayed_event_waits_and_holds_its_key
test_a_dead_key_holds_its_long_delayed_events_dead_too = (
    wal.test_a_dead_key_holds_its_long_delayed_events_dead_too
)
test_a_long_backoff_hands_the_key_over_and_the_next_relay_finishes_it_in_order = (
    wal.test_a_long_backoff_hands_the_key_over_and_the_next_relay_finishes_it_in_order
)
test_hand_over_order_follows_the_previous_relays_even_when_its_clock_was_ahead = (
    wal.test_hand_over_order_follows_the_previous_relays_even_when_its_clock_was_ahead
)


def test_status_and_metrics_show_the_binlog_lag_and_the_oldest_unpublished_event(
    feed: Feed,
) -> None:
    url, table = feed.logical_server.url, feed.table
    with watched_relay(feed, "binlog", "binlog-watched") as watched:
        seen = watched.seen
        assert seen["retained_bytes"] > 0 and seen["binlog_files"] >= 1
        assert seen["lag_transactions"] >= 1  # the held event's transaction
        text = run("status", "--db", url, "--table", table, "--source", "binlog").stdout
        assert "binlog source" in text and "read by connection" in text, text
        _, metrics = scrape(watched.port)
        # The held event's transaction keeps the position behind the binlog's end
        # (counted in transactions: a GTID is no byte offset).
        assert (gauge(metrics, "outbox_wal_lag_transactions") or 0) >= 1
        assert gauge(metrics, "outbox_wal_lag_bytes") is None
    assert watched.gone["lag_transactions"] > seen["lag_transactions"]


def test_the_binlog_library_failing_mid_stream_reconnects_and_loses_nothing(
    feed: Feed, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # python-mysql-replication can fail with errors of its own when the server goes
    # mid-packet: a new reader starts from the confirmed position; the cause is shown.
    rows = BinlogStream._rows
    failures = [AttributeError("'NoneType' object has no attribute 'read'")]

    def failing_once(event: Any) -> Any:
        if failures:
            raise failures.pop()
        return rows(event)

    monkeypatch.setattr(BinlogStream, "_rows", staticmethod(failing_once))
    queue = MemoryQueue("binlog-library-error")
    feed.start(MemoryBroker(queue))
    made = feed.enqueue(("a", {"n": 1}), ("a", {"n": 2}))
    wait_for(lambda: len(queue.snapshot()) >= 2, 20, "the events after the reconnect")
    assert [e.event_id for e in queue.snapshot()] == made
    assert "the binlog reader failed; reconnecting" in caplog.text
    assert "AttributeError" in caplog.text
