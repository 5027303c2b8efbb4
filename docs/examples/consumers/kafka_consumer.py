"""An idempotent Kafka consumer: each event's business effect happens once.

The outbox relay publishes every event at least once, with the event id in
the ``event_id`` header (``id`` with ``shape=debezium``); a consumer that
crashes before committing its offset reads records again. This consumer
makes the effect happen exactly once per event id: for each record it

1. begins a transaction on its database,
2. records the id in the inbox (``inbox.record``) -- first in the transaction,
3. applies the business effect only if the id was new,
4. commits (the record and the effect together, or neither),
5. then commits the record's offset to Kafka.

A record read again finds its id recorded and only moves the offset. When
the effect fails, the transaction rolls back, the id is not recorded, and the
consumer seeks back to the record to process it again. A record without an
``event_id`` header, or whose value is not JSON, cannot be processed and is
skipped with an error line (send it to a dead-letter topic in production).

The consumer's database holds its own inbox table (``outbox_inbox``, created
by ``inbox.install()`` when missing) beside the invoices: no outbox table.
Run it::

    pip install 'outbox-toolkit[postgresql,kafka]'
    python docs/examples/consumers/kafka_consumer.py --db postgresql+psycopg://app@db/billing \\
        --bootstrap kafka-1:9092 --topic order.created --group billing

The tests run it against librdkafka's mock cluster, fed by the toolkit's relay
(``tests/contract/test_consumer_examples.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, Message, TopicPartition

from outbox_core.errors import EventError
from outbox_core.inbox import Inbox, validate_consumer

log = logging.getLogger("billing")

#: The inbox key of this consumer: each consumer of an event records it separately.
CONSUMER = "billing"

#: The business effect: one invoice per order.
metadata = sa.MetaData()
invoices = sa.Table(
    "invoices",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("total", sa.Integer, nullable=False),
)

#: ``effect(conn, payload)`` applies the business effect in the given transaction.
Effect = Callable[[sa.Connection, Any], None]


def create_invoice(conn: sa.Connection, payload: Any) -> None:
    """The business effect of ``order.created``: invoice the order."""
    conn.execute(invoices.insert().values(order_id=payload["order_id"], total=payload["total"]))


def event_id_of(message: Message) -> str | None:
    """The event id the relay put in the record's headers (``id`` with shape=debezium), or None."""
    headers = dict(message.headers() or {})
    value = headers.get("event_id", headers.get("id"))
    return value.decode() if isinstance(value, bytes) else value


def position(message: Message) -> TopicPartition:
    """Where ``message`` is: its topic, partition and offset (to seek back to it)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("the message is not a record")
    return TopicPartition(topic, partition, offset)


def handle_record(
    engine: sa.Engine, inbox: Inbox, effect: Effect, message: Message, *, consumer: str = CONSUMER
) -> str:
    """Process one record; return ``processed``, ``duplicate``, ``retry`` or ``skipped``."""
    event_id = event_id_of(message)
    try:
        payload = json.loads(message.value() or b"")
    except ValueError:
        log.error("skipping %s: the value is not JSON", event_id)
        return "skipped"
    try:
        with engine.begin() as conn:  # one transaction: the inbox record and the effect
            first_time = inbox.record(conn, consumer, event_id or "")
            if first_time:
                effect(conn, payload)
            # else: processed before (the effect committed then); only move on.
    except EventError as exc:
        # No usable event id: it cannot be deduplicated, so it is not processed.
        log.error("skipping a record: %s", exc)
        return "skipped"
    except Exception:
        # Rolled back: nothing recorded, so reading the record again processes it.
        log.exception("processing %s failed; it will be read again", event_id)
        return "retry"
    return "processed" if first_time else "duplicate"


def consume(
    kafka: Consumer,
    engine: sa.Engine,
    inbox: Inbox,
    effect: Effect,
    *,
    consumer: str = CONSUMER,
    max_records: int | None = None,
    idle_seconds: float | None = None,
) -> dict[str, int]:
    """Handle records until ``max_records`` or ``idle_seconds`` without one; counts by result."""
    validate_consumer(consumer)  # a bad name fails here, not once per record
    counts: dict[str, int] = {}
    idle = 0.0
    while max_records is None or sum(counts.values()) < max_records:
        message = kafka.poll(0.5)
        if message is None:
            idle += 0.5
            if idle_seconds is not None and idle >= idle_seconds:
                break
            continue
        idle = 0.0
        if message.error() is not None:
            log.warning("consumer error: %s", message.error())
            continue
        result = handle_record(engine, inbox, effect, message, consumer=consumer)
        counts[result] = counts.get(result, 0) + 1
        if result == "retry":
            # Read it again: the offset is not committed, and the position goes back.
            kafka.seek(position(message))
            continue
        # Commit the offset only after the database commit: a crash in between
        # means reading the record again, which the inbox turns into a duplicate.
        kafka.commit(message=message, asynchronous=False)
    return counts


def main() -> None:
    """Consume ``--topic`` until interrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--db", required=True, help="the consumer's database URL")
    parser.add_argument("--bootstrap", default="localhost:9092")
    parser.add_argument("--topic", default="order.created")
    parser.add_argument("--group", default="billing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    engine = sa.create_engine(args.db)
    inbox = Inbox(engine)  # the consumer's own inbox table: outbox_inbox
    inbox.install()  # creates it if missing (and nothing else)
    metadata.create_all(engine)
    kafka = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": False,  # offsets move only after the database commit
            "auto.offset.reset": "earliest",
        }
    )
    kafka.subscribe([args.topic])
    try:
        consume(kafka, engine, inbox, create_invoice)
    except KeyboardInterrupt:
        pass
    finally:
        kafka.close()
        engine.dispose()


if __name__ == "__main__":
    main()
