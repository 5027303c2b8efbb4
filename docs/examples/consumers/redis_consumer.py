"""An idempotent Redis Streams consumer: each event's business effect happens once.

The outbox relay adds every event at least once to the stream (the ``redis``
broker drops a re-publish within ``dedup_ttl``, but a consumer must not rely
on that alone), with the event id in the entry's ``event_id`` field. This
consumer reads the stream in a consumer group and, for each entry,

1. begins a transaction on its database,
2. records the event id in the inbox (``inbox.record``) -- first in the transaction,
3. applies the business effect only if the id was new,
4. commits (the record and the effect together, or neither),
5. then acknowledges the entry (``XACK``).

An entry whose acknowledgement was lost (the consumer died after the commit)
stays in the group's pending list; a consumer takes it over after
``--claim-idle`` (``XAUTOCLAIM``), finds its id recorded and acknowledges it
without a second effect. When the effect fails, the transaction rolls back and
the entry stays pending, to be taken over and processed again. An entry
without a usable ``event_id`` or JSON ``payload`` cannot be processed: it is
logged and acknowledged (Redis Streams have no dead-letter queue).

The consumer's database holds its own inbox table (``outbox_inbox``, created
by ``inbox.install()`` when missing) beside the invoices: no outbox table.
Run it::

    pip install 'outbox-toolkit[postgresql,redis]'
    python docs/examples/consumers/redis_consumer.py --db postgresql+psycopg://app@db/billing \\
        --redis redis://cache:6379/0 --stream order.created --group billing

The tests run it against a real Redis, fed by the toolkit's relay
(``tests/contract/test_consumer_examples.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, cast

import redis
import sqlalchemy as sa

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
#: ``ack(entry_id)`` acknowledges one entry (``XACK``).
Ack = Callable[[bytes], Any]
#: What ``XREADGROUP`` returns: per stream, its entries (id, fields); None when none came.
Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None


def create_invoice(conn: sa.Connection, payload: Any) -> None:
    """The business effect of ``order.created``: invoice the order."""
    conn.execute(invoices.insert().values(order_id=payload["order_id"], total=payload["total"]))


def handle_entry(
    engine: sa.Engine,
    inbox: Inbox,
    effect: Effect,
    ack: Ack,
    entry_id: bytes,
    fields: dict[bytes, bytes],
    *,
    consumer: str = CONSUMER,
) -> str:
    """Process one entry; return ``processed``, ``duplicate``, ``retry`` or ``rejected``."""
    event_id = fields.get(b"event_id", b"").decode(errors="replace")
    try:
        payload = json.loads(fields[b"payload"])
    except (KeyError, ValueError):
        log.error("dropping entry %s (%s): no JSON payload", entry_id, event_id)
        ack(entry_id)
        return "rejected"
    try:
        with engine.begin() as conn:  # one transaction: the inbox record and the effect
            first_time = inbox.record(conn, consumer, event_id)
            if first_time:
                effect(conn, payload)
            # else: processed before (the effect committed then); only acknowledge.
    except EventError as exc:
        # No usable event id: it cannot be deduplicated, so it is not processed.
        log.error("dropping entry %s: %s", entry_id, exc)
        ack(entry_id)
        return "rejected"
    except Exception:
        # Rolled back: nothing recorded; the entry stays pending and is taken
        # over again after --claim-idle. (In production, bound the retries with
        # the delivery count XPENDING reports.)
        log.exception("processing %s failed; it stays pending", event_id)
        return "retry"
    # Acknowledge only after the commit: a crash in between leaves the entry
    # pending, and the inbox turns its next delivery into a duplicate.
    ack(entry_id)
    return "processed" if first_time else "duplicate"


def consume(
    client: redis.Redis,
    engine: sa.Engine,
    inbox: Inbox,
    effect: Effect,
    *,
    stream: str,
    group: str,
    name: str,
    stop: threading.Event,
    claim_idle_ms: int = 30_000,
    block_ms: int = 1_000,
    ack: Ack | None = None,
    consumer: str = CONSUMER,
) -> dict[str, int]:
    """Read ``stream`` as ``name`` in ``group`` until ``stop`` is set; counts per result."""
    validate_consumer(consumer)  # a bad name fails here, not once per entry
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):  # the group exists already: fine
            raise
    do_ack: Ack = ack or (lambda entry_id: client.xack(stream, group, entry_id))
    counts: dict[str, int] = {}
    while not stop.is_set():
        # Entries another consumer took and never acknowledged (it died), then new ones.
        claimed = client.xautoclaim(stream, group, name, claim_idle_ms, "0-0", count=50)
        entries: list[tuple[bytes, dict[bytes, bytes]]] = list(claimed[1])
        if not entries:
            read = client.xreadgroup(group, name, {stream: ">"}, count=50, block=block_ms)
            entries = [entry for _, batch in cast(Read, read) or [] for entry in batch]
        for entry_id, fields in entries:
            if fields is None:  # deleted (trimmed by maxlen) while pending
                do_ack(entry_id)
                continue
            result = handle_entry(
                engine, inbox, effect, do_ack, entry_id, fields, consumer=consumer
            )
            counts[result] = counts.get(result, 0) + 1
    return counts


def main() -> None:
    """Consume ``--stream`` until interrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--db", required=True, help="the consumer's database URL")
    parser.add_argument("--redis", default="redis://localhost:6379/0")
    parser.add_argument("--stream", default="order.created")
    parser.add_argument("--group", default="billing")
    parser.add_argument("--name", default=socket.gethostname(), help="this consumer's name")
    parser.add_argument("--claim-idle", type=int, default=30_000, help="milliseconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    engine = sa.create_engine(args.db)
    inbox = Inbox(engine)  # the consumer's own inbox table: outbox_inbox
    inbox.install()  # creates it if missing (and nothing else)
    metadata.create_all(engine)
    client = redis.Redis.from_url(args.redis)
    stop = threading.Event()
    try:
        consume(
            client, engine, inbox, create_invoice, stream=args.stream, group=args.group,
            name=args.name, stop=stop, claim_idle_ms=args.claim_idle,
        )  # fmt: skip
    except KeyboardInterrupt:
        stop.set()
    finally:
        client.close()
        engine.dispose()


if __name__ == "__main__":
    main()
