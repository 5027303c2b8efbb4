"""An idempotent RabbitMQ consumer: each event's business effect happens once.

The outbox relay publishes every event at least once, with the event id as
the AMQP ``message_id``; RabbitMQ redelivers a message whose acknowledgement
was lost. This consumer makes the effect happen exactly once per event id:
for each message it

1. begins a transaction on its database,
2. records the id in the inbox (``inbox.record``) -- first in the transaction,
3. applies the business effect only if the id was new,
4. commits (the record and the effect together, or neither),
5. then acknowledges the message (``basic_ack``).

A redelivered message finds its id recorded and is acknowledged without a
second effect. When the effect fails, the transaction rolls back, the id is
not recorded, and the message is requeued to be processed again. A message
without a usable ``message_id`` cannot be deduplicated and is rejected (to a
dead-letter exchange, if the queue has one).

The consumer's database holds its own inbox table (``outbox_inbox``, created
by ``inbox.install()`` when missing) beside the invoices: no outbox table.
Run it::

    pip install 'outbox-toolkit[postgresql,rabbitmq]'
    python docs/examples/consumers/rabbitmq_consumer.py --db postgresql+psycopg://app@db/billing \\
        --amqp amqp://guest:guest@rabbitmq:5672/%2F --exchange outbox \\
        --queue billing --binding 'order.#'

The tests run it against a real RabbitMQ, fed by the toolkit's relay
(``tests/contract/test_consumer_examples.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import pika
import sqlalchemy as sa
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

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


def handle_message(
    engine: sa.Engine,
    inbox: Inbox,
    effect: Effect,
    channel: BlockingChannel,
    method: Basic.Deliver,
    properties: BasicProperties,
    body: bytes,
    *,
    consumer: str = CONSUMER,
) -> str:
    """Process one delivery; return ``processed``, ``duplicate``, ``retry`` or ``rejected``."""
    try:
        payload = json.loads(body)
    except ValueError:
        log.error("rejecting message %s: the body is not JSON", properties.message_id)
        channel.basic_nack(method.delivery_tag, requeue=False)
        return "rejected"
    try:
        with engine.begin() as conn:  # one transaction: the inbox record and the effect
            first_time = inbox.record(conn, consumer, properties.message_id)
            if first_time:
                effect(conn, payload)
            # else: processed before (the effect committed then); only acknowledge.
    except EventError as exc:
        # No usable message_id: it cannot be deduplicated, so it is not processed.
        log.error("rejecting message: %s", exc)
        channel.basic_nack(method.delivery_tag, requeue=False)
        return "rejected"
    except Exception:
        # Rolled back: nothing recorded, so the redelivery is processed again.
        # (In production, bound the retries: a dead-letter exchange with a TTL.)
        log.exception("processing %s failed; requeued", properties.message_id)
        channel.basic_nack(method.delivery_tag, requeue=True)
        return "retry"
    # Acknowledge only after the commit: a crash in between means a redelivery,
    # which the inbox turns into a duplicate.
    channel.basic_ack(method.delivery_tag)
    return "processed" if first_time else "duplicate"


def make_callback(
    engine: sa.Engine, inbox: Inbox, effect: Effect, *, consumer: str = CONSUMER
) -> Callable[[BlockingChannel, Basic.Deliver, BasicProperties, bytes], Any]:
    """A pika ``on_message_callback`` running :func:`handle_message`."""
    validate_consumer(consumer)  # a bad name fails here, not once per message
    return functools.partial(handle_message, engine, inbox, effect, consumer=consumer)


def main() -> None:
    """Consume ``--queue`` until interrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--db", required=True, help="the consumer's database URL")
    parser.add_argument("--amqp", default="amqp://guest:guest@localhost:5672/%2F")
    parser.add_argument("--exchange", default="outbox", help="the relay's exchange")
    parser.add_argument("--queue", default="billing")
    parser.add_argument("--binding", default="order.#")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    engine = sa.create_engine(args.db)
    inbox = Inbox(engine)  # the consumer's own inbox table: outbox_inbox
    inbox.install()  # creates it if missing (and nothing else)
    metadata.create_all(engine)

    connection = pika.BlockingConnection(pika.URLParameters(args.amqp))
    channel = connection.channel()
    # The relay declares its exchange durable, of type topic: the same here.
    channel.exchange_declare(args.exchange, "topic", durable=True)
    channel.queue_declare(args.queue, durable=True)
    channel.queue_bind(args.queue, args.exchange, args.binding)
    channel.basic_qos(prefetch_count=20)  # unacknowledged messages in flight
    channel.basic_consume(
        args.queue, on_message_callback=make_callback(engine, inbox, create_invoice)
    )
    try:
        channel.start_consuming()
    except KeyboardInterrupt:
        channel.stop_consuming()
    finally:
        connection.close()
        engine.dispose()


if __name__ == "__main__":
    main()
