"""From Debezium's outbox event router to ``outbox relay`` on the same table (issue #38).

A team's outbox table in Debezium's layout (``id`` the event's UUID,
``aggregate_type``, ``aggregate_id``, ``event_type``, ``payload``), written
by plain SQL INSERTs, is published first by "Debezium": its outbox event
router with Kafka Connect's JsonConverter, emulated by a plain
confluent-kafka producer (Java's partitioner, ``murmur2_random``; the key as
a JSON string, quotes included; the payload's JSON as the value; header
``id``; topic ``events.<event_type>``). Then the cut-over: Debezium drained
and stopped, ``outbox install --columns ... --existing sent`` (the rows it
published are not published again), more rows, ``outbox relay`` with
``shape=debezium``, ``key_format=json`` and ``topic=events.${routedByValue}``.

A consumer reading the topics finds every row exactly once across the
cut-over, each with its ``id`` header, its key's JSON bytes, on the
partition Java's murmur2 gives the key, each key's records in insertion
order. By polling (PostgreSQL, MariaDB) and by log tailing (PostgreSQL,
``--source wal``); log tailing also with rows the team deletes in the
transaction that inserted them, as Debezium users do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer

from outbox_core.schema import OutboxTables
from tests.conftest import reachable_url
from tests.faults.private_servers import PrivatePostgres
from tests.kafka_mock import Cluster, Record, consume, java_partition, read_all
from tests.support import outbox_cli

pytestmark = pytest.mark.needs_server

COLUMNS = "event_id=id,key=aggregate_id,topic=event_type"
#: The relay's Kafka options that write the records Debezium's router wrote.
DEBEZIUM_OPTIONS = ("shape=debezium", "key_format=json", "topic=events.${routedByValue}")
#: Partitions of each topic (made before anyone produces).
PARTITIONS = 4
#: Each key's aggregate (its rows' event_type: the topic they are routed by).
KEYS = {
    "order-42": "order",
    "order-7": "order",
    "customer-3": "customer",
    "customer-11": "customer",
}
TOPICS = sorted({f"events.{kind}" for kind in KEYS.values()})

DDL = {
    "postgresql": (
        "CREATE TABLE {t} (id uuid PRIMARY KEY, aggregate_type varchar(255) NOT NULL, "
        "aggregate_id varchar(255) NOT NULL, event_type varchar(255) NOT NULL, payload jsonb)"
    ),
    "mysql": (
        "CREATE TABLE {t} (id char(36) PRIMARY KEY, aggregate_type varchar(255) NOT NULL, "
        "aggregate_id varchar(255) NOT NULL, event_type varchar(255) NOT NULL, payload json)"
    ),
}


@dataclass(frozen=True)
class Row:
    """One row the team's code wrote."""

    id: str
    key: str
    event_type: str
    payload: dict[str, Any]

    @property
    def topic(self) -> str:
        return f"events.{self.event_type}"

    @property
    def key_bytes(self) -> bytes:
        """The key as Kafka Connect's JsonConverter writes a string: ``"order-42"``."""
        return json.dumps(self.key).encode()


@dataclass
class Team:
    """The team's database and table, written with plain SQL as its code does."""

    url: str
    table: str
    engine: sa.Engine
    rows: list[Row] = field(default_factory=list)

    def insert(self, count: int, *, delete: bool = False) -> list[Row]:
        """``count`` rows, one transaction each, keys in turn (``delete``: the same
        transaction deletes the row again, Debezium's habit)."""
        made: list[Row] = []
        keys = list(KEYS)
        for _ in range(count):
            n = len(self.rows)
            key = keys[n % len(keys)]
            row = Row(str(uuid.uuid4()), key, KEYS[key], {"n": n, "key": key, "note": "é"})
            with self.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        f"INSERT INTO {self.table} "
                        "(id, aggregate_type, aggregate_id, event_type, payload) "
                        "VALUES (:id, :kind, :key, :kind, :payload)"
                    ),
                    {
                        "id": row.id,
                        "kind": row.event_type,
                        "key": row.key,
                        "payload": json.dumps(row.payload),
                    },
                )
                if delete:
                    conn.execute(
                        sa.text(f"DELETE FROM {self.table} WHERE id = :id"), {"id": row.id}
                    )
            self.rows.append(row)
            made.append(row)
        return made

    def ids_in_table(self) -> set[str]:
        with self.engine.connect() as conn:
            found = conn.execute(sa.text(f"SELECT id FROM {self.table}")).scalars()
            return {str(i) for i in found}

    def states(self) -> dict[int, int]:
        """state -> rows (after the adoption)."""
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(f"SELECT state, count(*) FROM {self.table} GROUP BY state")
            ).all()
            return {int(state): int(count) for state, count in found}


def debezium_publishes(cluster: Cluster, rows: list[Row]) -> None:
    """Debezium's outbox event router through Kafka Connect's JsonConverter
    (``schemas.enable=false``), drained: every row published and acknowledged."""
    producer = Producer(
        {
            "bootstrap.servers": cluster.bootstrap,
            # Kafka Connect is a Java producer: Java's partitioner.
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            "log_level": 0,
        }
    )
    errors: list[Any] = []
    for row in rows:
        producer.produce(
            row.topic,
            key=row.key_bytes,
            value=json.dumps(row.payload).encode(),
            headers=[("id", row.id.encode())],
            on_delivery=lambda err, _msg: errors.append(err) if err is not None else None,
        )
    assert producer.flush(30) == 0 and not errors, errors


@pytest.fixture
def team(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Team, str]]:
    """The team's Debezium-layout table on the variant's database; (team, source)."""
    backend, source = request.param
    if source == "wal":
        server: PrivatePostgres = request.getfixturevalue("machine_logical_server")
        url = server.url
    else:
        url = reachable_url(backend, tmp_path)
    table = f"dbz_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(DDL[backend].format(t=table)))
    try:
        yield Team(url, table, engine), source
    finally:
        if source == "wal":
            outbox_cli("uninstall", "--db", url, "--table", table, "--source", "wal")
        tables = OutboxTables.create(table, columns=COLUMNS)
        tables.metadata.drop_all(engine)
        engine.dispose()


def start_relay(team: Team, cluster: Cluster, source: str) -> subprocess.Popen[str]:
    options = [arg for option in DEBEZIUM_OPTIONS for arg in ("--broker-option", option)]
    mode = (
        ["--source", "wal"]
        if source == "wal"
        else ["--ordering", "partitions", "--poll-interval", "50ms"]
    )
    args = [
        sys.executable, "-m", "outbox_core.cli", "relay", "--db", team.url,
        "--table", team.table, "--columns", COLUMNS, "--broker", cluster.url, *options, *mode,
    ]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(relay: subprocess.Popen[str]) -> None:
    """SIGTERM: the relay finishes what it holds and exits 0."""
    if relay.returncode is not None:
        return  # it died: wait_for_records said why
    relay.send_signal(signal.SIGTERM)
    _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err[-3000:]


def wait_for_records(cluster: Cluster, count: int, relay: subprocess.Popen[str]) -> None:
    """Until ``count`` records are in the topics (the relay's errors if it died)."""
    try:
        consume(cluster.bootstrap, TOPICS, count, timeout=60)
    except AssertionError:
        if relay.poll() is not None:
            _, err = relay.communicate(timeout=10)
            raise AssertionError(f"the relay exited {relay.returncode}: {err[-3000:]}") from None
        raise


def check_records(records: list[Record], rows: list[Row]) -> None:
    """Every row exactly once, as Debezium's router writes it, each key in insertion order
    on Java's partition."""
    by_id = {row.id: row for row in rows}
    ids = [r.headers.get("id", b"").decode() for r in records]
    assert len(ids) == len(set(ids)), "a row was published twice"
    assert set(ids) == set(by_id), (
        f"missing {sorted(set(by_id) - set(ids))}, unknown {sorted(set(ids) - set(by_id))}"
    )
    for record, row_id in zip(records, ids, strict=True):
        row = by_id[row_id]
        assert record.topic == row.topic
        assert record.key is not None and record.key.encode() == row.key_bytes
        assert json.loads(record.value) == row.payload
        assert "event_id" not in record.headers  # Debezium's shape: header id only
        assert record.partition == java_partition(row.key_bytes, PARTITIONS), row.key
    for key in KEYS:
        wanted = [row.id for row in rows if row.key == key]
        mine = sorted((r for r in records if r.key == json.dumps(key)), key=lambda r: r.offset)
        assert {r.partition for r in mine} == {java_partition(json.dumps(key).encode(), PARTITIONS)}
        assert [r.headers["id"].decode() for r in mine] == wanted, f"order of {key}"


VARIANTS = [
    pytest.param(("postgresql", "table"), id="postgresql-polling"),
    pytest.param(("mysql", "table"), id="mariadb-polling"),
    pytest.param(("postgresql", "wal"), id="postgresql-log-tailing"),
]


@pytest.mark.parametrize("team", VARIANTS, indirect=True)
def test_debezium_cut_over_publishes_every_row_once_in_order_where_debezium_did(
    team: tuple[Team, str], cluster: Cluster
) -> None:
    db, source = team
    for topic in TOPICS:
        cluster.create_topic(topic, partitions=PARTITIONS)
    before = db.insert(12)
    debezium_publishes(cluster, before)  # drained, then stopped
    wal = ["--source", "wal"] if source == "wal" else []
    installed = outbox_cli(
        "install", "--db", db.url, "--table", db.table, "--columns", COLUMNS,
        "--existing", "sent", *wal,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    if source == "table":
        assert db.states() == {2: len(before)}  # what Debezium published is sent
    db.insert(8)  # written while no one publishes
    relay = start_relay(db, cluster, source)
    try:
        db.insert(8)  # and while the relay runs
        wait_for_records(cluster, len(db.rows), relay)
    finally:
        stop(relay)
    check_records(read_all(cluster.bootstrap, TOPICS), db.rows)
    if source == "table":
        assert db.states() == {2: len(db.rows)}


@pytest.mark.parametrize(
    "team", [pytest.param(("postgresql", "wal"), id="log-tailing")], indirect=True
)
def test_rows_deleted_where_they_were_inserted_are_published_by_log_tailing(
    team: tuple[Team, str], cluster: Cluster
) -> None:
    """Debezium's habit: the outbox row is deleted in the transaction that inserted it
    (the insert is in the log). Log tailing publishes each such row once; none is
    left in (or written back to) the table."""
    db, _ = team
    for topic in TOPICS:
        cluster.create_topic(topic, partitions=PARTITIONS)
    before = db.insert(6, delete=True)
    debezium_publishes(cluster, before)
    installed = outbox_cli(
        "install", "--db", db.url, "--table", db.table, "--columns", COLUMNS,
        "--existing", "sent", "--source", "wal",
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    db.insert(6, delete=True)
    relay = start_relay(db, cluster, "wal")
    try:
        db.insert(6, delete=True)
        wait_for_records(cluster, len(db.rows), relay)
    finally:
        stop(relay)
    check_records(read_all(cluster.bootstrap, TOPICS), db.rows)
    assert db.ids_in_table() == set()


@pytest.mark.parametrize("team", VARIANTS[:2], indirect=True)
def test_the_guides_cut_over_with_writes_throughout_repeats_only_the_overlap(
    team: tuple[Team, str], cluster: Cluster
) -> None:
    """docs/kafka.md's order, writers never paused: adopt while Debezium runs, Debezium
    publishes the rows written since (the overlap) until it stops, then the relay starts.
    Only the overlap goes out twice, with the same ``id`` header; dropping repeats by
    that id (as an inbox does) leaves every row once, each key in insertion order."""
    db, _ = team
    for topic in TOPICS:
        cluster.create_topic(topic, partitions=PARTITIONS)
    before = db.insert(8)
    debezium_publishes(cluster, before)
    installed = outbox_cli(
        "install", "--db", db.url, "--table", db.table, "--columns", COLUMNS,
        "--existing", "sent",
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    overlap = db.insert(6)  # pending for the relay, and Debezium still runs
    debezium_publishes(cluster, overlap)  # drained past the install, then stopped
    relay = start_relay(db, cluster, "table")
    try:
        db.insert(6)
        wait_for_records(cluster, len(db.rows) + len(overlap), relay)
    finally:
        stop(relay)
    records = read_all(cluster.bootstrap, TOPICS)
    ids = [r.headers["id"].decode() for r in records]
    repeated = {i for i in ids if ids.count(i) > 1}
    assert repeated == {row.id for row in overlap}  # no needless duplicate
    assert all(ids.count(i) == 2 for i in repeated)
    first: dict[str, Record] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        first.setdefault(record.headers["id"].decode(), record)
    check_records(sorted(first.values(), key=lambda r: (r.partition, r.offset)), db.rows)
