"""Log tailing (``--source wal``) of a team's own table, read through a column map.

The table is Debezium's outbox layout (``id uuid``, ``aggregate_type NOT
NULL``, ``aggregate_id``, ``event_type``, ``payload jsonb``), adopted with
``outbox install --source wal --columns ...`` and written by plain SQL
INSERTs. Covered: events built from the log's rows by the table's column
names, the key's order; a rejected event dead in the team's row, its key's
later events held dead, ``outbox replay`` bringing them back through the
stream; a long delay handed to the table and published from it; the index of
the rows handed over built on the ordering column ``outbox_seq``. The relay
writes only the toolkit's columns of rows that are there: the team's
``NOT NULL`` column never stops it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.cli.wal import tailing_relay
from outbox_core.dialects.postgresql.wal import SlotInUse
from outbox_core.message import Event, Outcome, State
from outbox_core.relay.tailing import TailingRelay
from tests.contract.test_wal_relay import wait_for
from tests.faults.private_servers import PrivatePostgres
from tests.support import outbox_cli, retry

pytestmark = pytest.mark.needs_server

COLUMNS = "event_id=id,key=aggregate_id,topic=event_type"


@dataclass
class Adopted:
    """A Debezium-layout table adopted for log tailing, and the relays started on it."""

    url: str
    table: str
    outbox: Outbox
    relays: list[TailingRelay] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def insert(self, *rows: tuple[str, dict[str, Any]], delay: float = 0) -> list[str]:
        """One transaction of plain INSERTs of ``(key, payload)``; their ids.

        ``delay``: due that many seconds later (``available_at``, the toolkit's column).
        """
        ids: list[str] = []
        due = ", available_at" if delay else ""
        at = ", now() + make_interval(secs => :delay)" if delay else ""
        with self.outbox.engine.begin() as conn:
            for key, payload in rows:
                ids.append(str(uuid.uuid4()))
                conn.execute(
                    sa.text(
                        f"INSERT INTO {self.table} "
                        f"(id, aggregate_type, aggregate_id, event_type, payload{due}) "
                        f"VALUES (:id, 'order', :key, 'order_event', :payload{at})"
                    ),
                    {"id": ids[-1], "key": key, "payload": json.dumps(payload), "delay": delay},
                )
        return ids

    def start(self, broker: Any, **knobs: Any) -> TailingRelay:
        settings = self.outbox.settings.replace(**knobs)
        relay = tailing_relay(self.outbox, broker, settings, f"cols-{len(self.relays)}")
        thread = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
        thread.start()
        self.relays.append(relay)
        self.threads.append(thread)
        return relay

    def rows(self) -> dict[str, tuple[int, str | None, str]]:
        """id -> (state, last_error, aggregate_type), by the table's own column names."""
        with self.outbox.engine.connect() as conn:
            found = conn.execute(
                sa.text(f"SELECT id, state, last_error, aggregate_type FROM {self.table}")
            )
            return {str(r[0]): (int(r[1]), r[2], str(r[3])) for r in found}


@pytest.fixture
def adopted(logical_server: PrivatePostgres) -> Iterator[Adopted]:
    url = logical_server.url
    table = f"dbzw_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE {table} (id uuid PRIMARY KEY, aggregate_type varchar(255) NOT "
                "NULL, aggregate_id varchar(255) NOT NULL, event_type varchar(255) NOT NULL, "
                "payload jsonb)"
            )
        )
    engine.dispose()
    installed = outbox_cli(
        "install", "--db", url, "--table", table, "--columns", COLUMNS, "--source", "wal"
    )
    assert installed.returncode == 0, installed.stderr
    outbox = Outbox(url, table=table, columns=COLUMNS)
    made = Adopted(url, table, outbox)
    try:
        yield made
    finally:
        for relay in made.relays:
            relay.stop()
        for thread in made.threads:
            thread.join(30)
        uninstall = ("uninstall", "--db", url, "--table", table, "--source", "wal")
        retry(lambda: _succeeds(outbox_cli(*uninstall)), SlotInUse, within=15)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def _succeeds(result: Any) -> None:
    if result.returncode != 0:
        raise SlotInUse(result.stderr)


def test_install_builds_the_handed_over_rows_index_on_the_ordering_column(
    adopted: Adopted,
) -> None:
    with adopted.outbox.engine.connect() as conn:
        indexes = sa.inspect(conn).get_indexes(adopted.table)
    [deferred] = [ix for ix in indexes if ix["name"] == f"ix_{adopted.table}_wal_deferred"]
    assert deferred["column_names"] == ["lease_until", "outbox_seq"]


def test_rows_inserted_by_plain_sql_are_events_by_the_tables_column_names(
    adopted: Adopted,
) -> None:
    queue = MemoryQueue("wal-columns")
    adopted.start(MemoryBroker(queue))
    first = adopted.insert(("order-42", {"n": 1}), ("order-7", {"n": 2}))
    second = adopted.insert(("order-42", {"n": 3}))
    wait_for(lambda: len(queue.snapshot()) == 3, 20, "3 events")
    events = {e.event_id: e for e in queue.snapshot()}
    assert set(events) == set(first + second)
    one = events[first[0]]
    assert (one.topic, one.key, one.payload) == ("order_event", "order-42", {"n": 1})
    assert one.id < events[second[0]].id  # outbox_seq, numbered by the table
    order = [e.event_id for e in queue.snapshot() if e.key == "order-42"]
    assert order == [first[0], second[0]]
    assert {s for s, _, _ in adopted.rows().values()} == {int(State.PENDING)}


def test_a_rejected_event_is_dead_in_the_teams_row_and_replay_brings_its_key_back(
    adopted: Adopted,
) -> None:
    queue = MemoryQueue("wal-columns-dead")
    poisoned = threading.Event()
    poisoned.set()

    def decide(event: Event) -> Outcome | None:
        if poisoned.is_set() and event.payload.get("poison"):
            return Outcome.reject("poison")
        return None

    relay = adopted.start(MemoryBroker(queue, decide=decide))
    bad, held = adopted.insert(("order-1", {"poison": True}), ("order-1", {"n": 2}))
    (other,) = adopted.insert(("order-2", {"n": 3}))
    wait_for(lambda: adopted.rows()[held][0] == State.DEAD, 15, "the key held dead")
    assert thread_alive(adopted)
    rows = adopted.rows()
    # The team's row, its own NOT NULL column kept: updated, not written again.
    assert rows[bad] == (int(State.DEAD), "poison", "order")
    assert "earlier event of key 'order-1' is dead" in (rows[held][1] or "")
    assert [e.event_id for e in queue.snapshot()] == [other] and relay.dead == 2
    poisoned.clear()
    replayed = outbox_cli(
        "replay", "--db", adopted.url, "--table", adopted.table, "--columns", COLUMNS,
        "--key", "order-1",
    )  # fmt: skip
    assert replayed.returncode == 0 and "replayed 2 dead events" in replayed.stdout, replayed.stderr
    wait_for(lambda: len(queue.snapshot()) == 3, 15, "the replayed events, from the stream")
    assert [e.event_id for e in queue.snapshot()] == [other, bad, held]


def test_a_long_delay_waits_in_the_teams_row_and_is_published_from_it(
    adopted: Adopted,
) -> None:
    queue = MemoryQueue("wal-columns-defer")
    relay = adopted.start(MemoryBroker(queue), defer_after=0.5)
    (late,) = adopted.insert(("order-9", {"n": 1}), delay=2)
    (behind,) = adopted.insert(("order-9", {"n": 2}))
    (other,) = adopted.insert(("order-3", {"n": 3}))
    wait_for(lambda: relay.deferred >= 1, 10, "the delayed event handed to the table")
    wait_for(lambda: len(queue.snapshot()) == 3, 15, "all three")
    assert [e.event_id for e in queue.snapshot()] == [other, late, behind]
    assert thread_alive(adopted)
    rows = adopted.rows()
    assert rows[late] == (int(State.SENT), None, "order") and rows[behind][0] == State.SENT
    assert rows[other][0] == State.PENDING  # from the stream: the row is not touched


def thread_alive(adopted: Adopted) -> bool:
    return all(thread.is_alive() for thread in adopted.threads)
