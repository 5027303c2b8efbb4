"""An idempotent NATS JetStream consumer: each event's business effect happens once.

The outbox relay publishes every event at least once, with the event id as
``Nats-Msg-Id`` (JetStream drops a re-publish inside the stream's duplicate
window; a redelivery after a lost acknowledgement still reaches consumers).
This consumer pulls from a durable consumer and, for each message,

1. begins a transaction on its database,
2. records the event id in the inbox (``inbox.record``) -- first in the transaction,
3. applies the business effect only if the id was new,
4. commits (the record and the effect together, or neither),
5. then acknowledges the message (``msg.ack()``).

A message whose acknowledgement was lost is redelivered after the consumer's
``ack_wait``, finds its id recorded and is acknowledged without a second
effect. When the effect fails, the transaction rolls back, the id is not
recorded, and the message is negatively acknowledged to be redelivered. A
message without a usable ``Nats-Msg-Id`` or JSON body is terminated
(``msg.term()``: never redelivered).

The database work runs in a worker thread (``asyncio.to_thread``), so the
event loop keeps the connection alive meanwhile.

The consumer's database holds its own inbox table (``outbox_inbox``, created
by ``inbox.install()`` when missing) beside the invoices: no outbox table.
The stream is the operator's (``nats stream add ORDERS --subjects 'order.>'``);
the durable consumer is created on first use. Run it::

    pip install 'outbox-toolkit[postgresql,nats]'
    python docs/examples/consumers/nats_consumer.py --db postgresql+psycopg://app@db/billing \\
        --nats nats://nats:4222 --stream ORDERS --subject 'order.>' --durable billing

The tests run it against a real NATS, fed by the toolkit's relay
(``tests/contract/test_consumer_examples.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import nats
import sqlalchemy as sa
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

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


def record_and_apply(
    engine: sa.Engine, inbox: Inbox, effect: Effect, event_id: str, payload: Any, consumer: str
) -> bool:
    """One transaction: the inbox record, and the effect if the id is new. True: it was new."""
    with engine.begin() as conn:
        first_time = inbox.record(conn, consumer, event_id)
        if first_time:
            effect(conn, payload)
        # else: processed before (the effect committed then); only acknowledge.
    return first_time


async def handle_message(
    engine: sa.Engine, inbox: Inbox, effect: Effect, msg: Msg, *, consumer: str = CONSUMER
) -> str:
    """Process one message; return ``processed``, ``duplicate``, ``retry`` or ``rejected``."""
    event_id = (msg.headers or {}).get("Nats-Msg-Id", "")
    try:
        payload = json.loads(msg.data)
    except ValueError:
        log.error("terminating message %s: the body is not JSON", event_id)
        await msg.term()
        return "rejected"
    try:
        first_time = await asyncio.to_thread(
            record_and_apply, engine, inbox, effect, event_id, payload, consumer
        )
    except EventError as exc:
        # No usable event id: it cannot be deduplicated, so it is not processed.
        log.error("terminating message: %s", exc)
        await msg.term()
        return "rejected"
    except Exception:
        # Rolled back: nothing recorded, so the redelivery is processed again.
        # (In production, bound the retries: the consumer's max_deliver.)
        log.exception("processing %s failed; redelivered later", event_id)
        await msg.nak()
        return "retry"
    # Acknowledge only after the commit: a crash in between means a redelivery,
    # which the inbox turns into a duplicate.
    await msg.ack()
    return "processed" if first_time else "duplicate"


async def consume(
    url: str,
    engine: sa.Engine,
    inbox: Inbox,
    effect: Effect,
    *,
    stream: str,
    subject: str,
    durable: str,
    stop: asyncio.Event,
    ack_wait: float = 30.0,
    handle: Callable[..., Any] = handle_message,
    consumer: str = CONSUMER,
) -> dict[str, int]:
    """Pull from the durable ``durable`` of ``stream`` until ``stop``; counts per result."""
    validate_consumer(consumer)  # a bad name fails here, not once per message
    nc = await nats.connect(url)
    counts: dict[str, int] = {}
    try:
        js = nc.jetstream()
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait)
        sub = await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
        while not stop.is_set():
            try:
                messages = await sub.fetch(batch=50, timeout=1)
            except TimeoutError:  # nothing to fetch (nats-py raises either kind)
                continue
            for msg in messages:
                result = await handle(engine, inbox, effect, msg, consumer=consumer)
                counts[result] = counts.get(result, 0) + 1
    finally:
        await nc.close()
    return counts


def main() -> None:
    """Consume ``--subject`` of ``--stream`` until interrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--db", required=True, help="the consumer's database URL")
    parser.add_argument("--nats", default="nats://localhost:4222")
    parser.add_argument("--stream", default="ORDERS")
    parser.add_argument("--subject", default="order.>")
    parser.add_argument("--durable", default="billing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    engine = sa.create_engine(args.db)
    inbox = Inbox(engine)  # the consumer's own inbox table: outbox_inbox
    inbox.install()  # creates it if missing (and nothing else)
    metadata.create_all(engine)
    stop = asyncio.Event()
    try:
        asyncio.run(
            consume(
                args.nats, engine, inbox, create_invoice, stream=args.stream,
                subject=args.subject, durable=args.durable, stop=stop,
            )
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
