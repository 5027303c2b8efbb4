"""Bad input gets the toolkit's own error; nothing is written; the transaction stays usable.

- a connection in autocommit mode is refused: the event could not roll back
  with the business write;
- a payload nested deeper than the toolkit (100) or the database (MariaDB: 31)
  takes is a ``PayloadError`` naming the depth, never a ``RecursionError`` or
  the server's raw CHECK failure; ``outbox migrate --check-only`` finds it;
- a payload over ``max_payload_bytes`` (16 MiB by default) is refused at enqueue;
- a missing outbox table is ``TableMissing`` naming ``outbox install``;
- a delay whose due time no database stores, and keys JSON would merge into
  one (``1`` and ``"1"``), are refused before anything is written;
- ``Outbox(json_default=...)`` encodes Decimal, datetime, UUID, dataclasses and
  pydantic models, and every check applies to the encoded result.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from brokers.memory import MemoryBroker, MemoryQueue
from outbox_core import Outbox
from outbox_core.encoding import encode_value
from outbox_core.errors import ConfigurationError, EventError, PayloadError, TableMissing
from outbox_core.transaction import SQLAlchemyTransaction
from tests.contract.test_migrate import Make, cli, make, run  # noqa: F401 - the fixture


def count(outbox: Outbox) -> int:
    with outbox.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox.table)).scalar_one())


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# -- autocommit cannot be atomic ----------------------------------------------------------


def test_an_autocommit_connection_is_refused_and_nothing_is_written(outbox: Outbox) -> None:
    with outbox.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(ConfigurationError, match="autocommit"):
            outbox.enqueue(conn, "t", {"n": 1})
        with pytest.raises(ConfigurationError, match="autocommit"):
            outbox.enqueue_many(conn, [{"topic": "t", "payload": {}}])
    assert count(outbox) == 0


def test_an_engine_made_autocommit_is_refused(outbox: Outbox) -> None:
    engine = sa.create_engine(outbox.engine.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn, pytest.raises(ConfigurationError, match="autocommit"):
            outbox.enqueue(conn, "t", {"n": 1})
    finally:
        engine.dispose()
    assert count(outbox) == 0


def test_a_connection_that_begins_on_its_first_statement_is_accepted(outbox: Outbox) -> None:
    with outbox.engine.connect() as conn:
        outbox.enqueue(conn, "t", {"n": 1})
        conn.rollback()
        outbox.enqueue(conn, "t", {"n": 2})
        conn.commit()
    assert count(outbox) == 1


# -- nesting depth ---------------------------------------------------------------------------


def test_a_payload_nested_1000_deep_is_a_payload_error_naming_the_depth(outbox: Outbox) -> None:
    with outbox.engine.connect() as conn, conn.begin():
        with pytest.raises(PayloadError, match=r"nested 1000 deep .* limit is 100"):
            outbox.enqueue(conn, "t", nested(1000))
        with pytest.raises(PayloadError, match=r"nested 101 deep"):
            outbox.enqueue(conn, "t", {"deep": nested(100)})
        outbox.enqueue(conn, "t", nested(20))  # the transaction is still usable
    assert count(outbox) == 1


def test_each_database_takes_the_depths_it_can_store(outbox: Outbox, backend: str) -> None:
    """MariaDB's JSON refuses 32 nested arrays: refused at enqueue, by the toolkit."""
    with outbox.engine.connect() as conn:
        mariadb = outbox.dialect.server_info(conn).product == "MariaDB"
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", nested(31))
        if mariadb:
            with pytest.raises(PayloadError, match=r"nested 32 deep .* at most 31"):
                outbox.enqueue(conn, "t", nested(32))
        else:
            outbox.enqueue(conn, "t", nested(32))
    assert count(outbox) == (1 if mariadb else 2)


@pytest.mark.needs_server
def test_migrate_check_only_finds_what_the_target_cannot_nest(make: Make) -> None:  # noqa: F811
    source = make("postgresql")
    target = make("mysql")
    with target.engine.connect() as conn:
        if target.dialect.server_info(conn).product != "MariaDB":
            pytest.skip("MySQL 8 takes 100 nested arrays, as the toolkit does")
    with source.engine.begin() as conn:
        deep = source.enqueue(conn, "t", {"tree": nested(40)})
    check = run(cli(source, target, "--check-only"))
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"event {deep}" in check.stdout and "nested" in check.stdout, check.stdout
    copy = run(cli(source, target))  # the copy itself names the event, writes nothing
    assert copy.returncode != 0
    assert f"event {deep}" in copy.stdout + copy.stderr and "nested" in copy.stdout + copy.stderr
    assert count(target) == 0


# -- payload size ----------------------------------------------------------------------------


def test_a_payload_over_max_payload_bytes_is_refused_at_enqueue(
    db_url: str, table_name: str
) -> None:
    """The 16 MiB default: a 20 MB payload is refused at enqueue, not made dead at publish."""
    outbox = Outbox(db_url, table=table_name)
    outbox.install()
    small = Outbox(db_url, table=table_name, max_payload_bytes=1000)
    try:
        with outbox.engine.connect() as conn, conn.begin():
            with pytest.raises(PayloadError, match=r"20,000,0\d\d bytes .* at most 16,777,216"):
                outbox.enqueue(conn, "t", {"blob": "x" * 20_000_000})
            with pytest.raises(PayloadError, match=r"at most 1,000 \(max_payload_bytes\)"):
                small.enqueue(conn, "t", {"blob": "ж" * 500})  # 1,000 bytes of UTF-8 and more
            small.enqueue(conn, "t", {"blob": "x" * 900})  # the transaction stays usable
        assert count(outbox) == 1
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
        small.dispose()


def test_max_payload_bytes_is_a_setting_from_the_environment() -> None:
    from outbox_core.config import load_settings

    assert load_settings(env={"OUTBOX_MAX_PAYLOAD_BYTES": "1048576"}).max_payload_bytes == 2**20
    assert load_settings(env={}).max_payload_bytes == 16 * 2**20


# -- a missing table -------------------------------------------------------------------------


def test_a_missing_table_is_table_missing_and_the_transaction_stays_usable(
    db_url: str, table_name: str
) -> None:
    outbox = Outbox(db_url, table=table_name)  # never installed
    try:
        with outbox.engine.connect() as conn, conn.begin():
            with pytest.raises(TableMissing, match="outbox install"):
                outbox.enqueue(conn, "t", {"n": 1})
            with pytest.raises(TableMissing, match="outbox install"):
                outbox.enqueue_many(conn, [{"topic": "t", "payload": {}}])
            # A refused INSERT would have aborted the transaction on PostgreSQL.
            assert conn.execute(sa.select(sa.literal(1))).scalar_one() == 1
    finally:
        outbox.dispose()


# -- the payload encoder hook ------------------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal


def test_json_default_encodes_everyday_values_and_the_relay_publishes_them(
    db_url: str, table_name: str
) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Customer(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        id: uuid.UUID
        since: dt.date

    order_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    payload = {
        "id": order_id,
        "total": decimal.Decimal("12.50"),
        "at": dt.datetime(2026, 11, 24, 10, 0, tzinfo=dt.UTC),
        "colour": Colour.RED,
        "lines": [Line("a-1", decimal.Decimal("1.10"))],
        "customer": Customer(id=order_id, since=dt.date(2020, 1, 2)),
    }
    plain = Outbox(db_url, table=table_name)
    plain.install()
    outbox = Outbox(db_url, table=table_name, json_default=encode_value)
    queue = MemoryQueue(f"encoded-{table_name}")
    try:
        with plain.engine.begin() as conn, pytest.raises(PayloadError, match="json_default"):
            plain.enqueue(conn, "order.created", payload)
        with outbox.engine.begin() as conn:
            outbox.enqueue(conn, "order.created", payload)
            outbox.enqueue_many(conn, [{"topic": "order.created", "payload": payload}])
        relay = outbox.relay(MemoryBroker(queue))
        while relay.run_once().claimed:
            pass
        relay.close()
    finally:
        plain.tables.metadata.drop_all(plain.engine)
        plain.dispose()
        outbox.dispose()
    expected = {
        "id": str(order_id),
        "total": "12.50",
        "at": "2026-11-24T10:00:00+00:00",
        "colour": "red",
        "lines": [{"sku": "a-1", "price": "1.10"}],
        "customer": {"id": str(order_id), "since": "2020-01-02"},
    }
    assert [e.payload for e in queue.snapshot()] == [expected, expected]


def test_every_check_applies_to_the_encoded_result(outbox: Outbox, db_url: str) -> None:
    class Opaque:
        pass

    deep = Outbox(db_url, table=outbox.table.name, json_default=lambda value: nested(200))
    refusing = Outbox(db_url, table=outbox.table.name, json_default=encode_value)
    try:
        with deep.engine.begin() as conn, pytest.raises(PayloadError, match="nested"):
            deep.enqueue(conn, "t", {"x": Opaque()})
        with (
            refusing.engine.begin() as conn,
            pytest.raises(PayloadError, match=r"payload\['x'\].*encoder refused"),
        ):
            refusing.enqueue(conn, "t", {"x": Opaque()})
    finally:
        deep.dispose()
        refusing.dispose()
    assert count(outbox) == 0


def test_a_port_without_a_connection_of_its_own_is_looked_at_once(outbox: Outbox) -> None:
    """The first look (capabilities, the table) runs on the outbox's engine once, not per event."""
    looks: list[int] = []
    fallback = outbox.producer._fallback

    def counted() -> sa.Connection:
        looks.append(1)
        return fallback()

    outbox.producer._fallback = counted
    with outbox.engine.begin() as conn:
        sa_port = SQLAlchemyTransaction.of(conn, "test")

        class NoBind:
            driver = sa_port.driver
            bind = None
            autocommit = sa_port.autocommit
            first_event = sa_port.first_event
            execute = sa_port.execute
            after_commit = sa_port.after_commit

        for n in range(3):
            outbox.producer.enqueue(NoBind(), outbox.producer.event("t", {"n": n}), notify=False)
    assert looks == [1]
    assert count(outbox) == 3


# -- the portable topic grammar -----------------------------------------------------------

NOT_PORTABLE = [
    "order created",  # a space: not a Kafka topic, not a NATS subject
    "order.*",  # an AMQP and NATS wildcard
    "order.#",  # an AMQP wildcard
    "order.>",  # a NATS wildcard
    "order..created",  # an empty word: not a NATS subject
    ".order",
    "order.",
    "заказ.создан",  # not ASCII: not a Kafka topic
    "orders/eu",
    "o" * 250,  # Kafka's limit is 249
]


@pytest.mark.parametrize("topic", NOT_PORTABLE)
def test_a_topic_no_broker_routes_alike_is_refused_and_the_transaction_stays_usable(
    outbox: Outbox, topic: str
) -> None:
    with outbox.engine.begin() as conn:
        with pytest.raises(EventError, match="is not portable"):
            outbox.enqueue(conn, topic, {"n": 1})
        with pytest.raises(EventError, match="is not portable"):
            outbox.enqueue_many(
                conn, [{"topic": "ok", "payload": {}}, {"topic": topic, "payload": {}}]
            )
        outbox.enqueue(conn, "order.created", {"n": 2})  # the transaction goes on
    assert count(outbox) == 1


def test_portable_topics_are_taken(outbox: Outbox) -> None:
    topics = ["order", "order.created", "Orders_v2-eu.created", "a.b.c.d", "o" * 249]
    with outbox.engine.begin() as conn:
        for topic in topics:
            outbox.enqueue(conn, topic, {})
    with outbox.engine.connect() as conn:
        stored = set(conn.execute(sa.select(outbox.table.c.topic)).scalars())
    assert stored == set(topics)


def test_portable_topics_off_stores_any_text_for_the_broker_to_judge(outbox: Outbox) -> None:
    loose = Outbox(outbox.engine, table=outbox.table.name, portable_topics=False)
    with outbox.engine.begin() as conn:
        loose.enqueue(conn, "order created", {})
        with pytest.raises(EventError, match="non-empty"):
            loose.enqueue(conn, " ", {})
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.select(outbox.table.c.topic)).scalar_one() == "order created"


def test_portable_topics_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox_core.config import load_settings

    monkeypatch.setenv("OUTBOX_PORTABLE_TOPICS", "false")
    assert load_settings().portable_topics is False


# -- values beyond what a database stores ------------------------------------------------------

OUT_OF_RANGE_DELAYS = [
    dt.timedelta(days=999_999_999),
    1e300,
    float("inf"),
    36501 * 86400,
]


@pytest.mark.parametrize("delay", OUT_OF_RANGE_DELAYS, ids=["999999999d", "1e300", "inf", "100y+"])
def test_a_delay_beyond_the_timestamp_columns_is_refused_and_the_transaction_stays_usable(
    outbox: Outbox, delay: Any
) -> None:
    marker = sa.Table(f"{outbox.table.name}_biz", sa.MetaData(), sa.Column("n", sa.Integer))
    marker.create(outbox.engine)
    try:
        with outbox.engine.begin() as conn:
            conn.execute(marker.insert().values(n=1))  # the business write, before the event
            with pytest.raises(EventError, match="delay"):
                outbox.enqueue(conn, "t", {"n": 1}, delay=delay)
            # A batch with one such delay writes none of its events.
            good = [{"topic": "t", "payload": {"n": i}} for i in range(5)]
            with pytest.raises(EventError, match=r"events\[5\]: delay"):
                outbox.enqueue_many(conn, [*good, {"topic": "t", "payload": {}, "delay": delay}])
            conn.execute(marker.insert().values(n=2))  # the transaction goes on
        with outbox.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(marker)).scalar_one() == 2
        assert count(outbox) == 0
    finally:
        marker.drop(outbox.engine)


def test_the_longest_delay_is_stored(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, delay=dt.timedelta(days=36500))
    assert count(outbox) == 1


# -- keys JSON would merge -------------------------------------------------------------------

MERGING = [
    {1: "x", "1": "y"},
    {"order": {2.5: "a", "2.5": "b"}},
    {"lines": [{True: 1, "true": 2}]},
    {None: 1, "null": 2},
]


@pytest.mark.parametrize("payload", MERGING, ids=["int-str", "float-nested", "bool-list", "none"])
def test_keys_json_would_merge_are_refused_not_silently_dropped(
    outbox: Outbox, payload: Any
) -> None:
    with outbox.engine.begin() as conn:
        with pytest.raises(PayloadError, match="same key in JSON"):
            outbox.enqueue(conn, "t", payload)
        outbox.enqueue(conn, "t", {1: "x", 2: "y"})  # keys that do not collide are fine
    with outbox.engine.connect() as conn:
        stored = conn.execute(sa.select(outbox.table.c.payload)).scalar_one()
    assert stored == {"1": "x", "2": "y"}
