"""Relay throughput PostgreSQL -> RabbitMQ against the raw confirmed-publish ceiling.

Prints, in one run and with the same batch size:

1. raw: pika alone publishing persistent messages to the same exchange, a
   batch at a time, waiting for the batch's publisher confirms (no database),
   twice: with the properties the relay sends (a message id, type, timestamp
   and the key and attempt headers, built per message: the ceiling the ratio
   uses) and with one shared minimal property set (for reference);
2. relay: events prefilled in the outbox table, drained by one relay to
   RabbitMQ (claim -> publish with confirms -> mark sent), until all are sent;
3. the ratio relay / raw (target >= 0.7).

    python bench/relay_rabbitmq.py --events 50000 --batch 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pika
import pika.spec
from pika.adapters.select_connection import IOLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_until_sent
from outbox_core import Outbox
from outbox_core.brokers.rabbitmq import ATTEMPT_HEADER, KEY_HEADER, RabbitMQBroker


def same_properties(i: int) -> pika.BasicProperties:
    """What the relay's broker sends with an event (see RabbitMQBroker.build_message)."""
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        message_id=str(uuid.uuid4()),
        type="bench.relay",
        timestamp=int(time.time()),
        headers={KEY_HEADER: f"k{i % 100}", ATTEMPT_HEADER: 1},
    )


MINIMAL = pika.BasicProperties(delivery_mode=2, content_type="application/json")


def raw_confirmed_rate(
    url: str,
    exchange: str,
    total: int,
    batch: int,
    body: bytes,
    properties: Callable[[int], pika.BasicProperties],
) -> float:
    """Messages/s for pika publishing ``batch`` messages, then waiting for their confirms."""
    state = {"pending": 0, "channel": None}
    loop = IOLoop()

    def on_confirm(frame: pika.frame.Method) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            raise RuntimeError("nack in the raw benchmark")
        # With multiple=True one ack covers every tag up to delivery_tag.
        acked = method.delivery_tag - state["acked"] if method.multiple else 1
        state["acked"] += acked
        state["pending"] -= acked
        if state["pending"] == 0:
            loop.stop()

    def on_channel(channel: pika.channel.Channel) -> None:
        state["channel"] = channel
        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=lambda _f: loop.stop())

    connection = pika.SelectConnection(
        pika.URLParameters(url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        custom_ioloop=loop,
    )
    state["acked"] = 0
    loop.start()  # until confirm mode is on
    channel = state["channel"]
    started = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(batch, total - sent)
        for i in range(sent, sent + n):
            channel.basic_publish(exchange, "bench.raw", body, properties(i))  # type: ignore[union-attr]
        state["pending"] = n
        sent += n
        loop.start()  # until the batch is confirmed
    elapsed = time.perf_counter() - started
    connection.close()
    return total / elapsed


def prefill(outbox: Outbox, total: int) -> None:
    payload = {"order_id": 0, "total": 1999, "currency": "EUR", "lines": [1, 2, 3]}
    with outbox.engine.begin() as conn:
        for i in range(total):
            outbox.enqueue(conn, "bench.relay", dict(payload, order_id=i), key=f"k{i % 100}")


def relay_rate(outbox: Outbox, url: str, exchange: str, total: int, batch: int) -> float:
    """Events/s for ``Relay.run()`` (pipelined) draining ``total`` prefilled events."""
    broker = RabbitMQBroker.from_url(url, exchange=exchange)
    relay = outbox.relay(broker, batch_size=batch, reap_interval=0, cleanup_after=0)
    return run_until_sent(relay, total, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:8]
    exchange, queue = f"bench.{suffix}", f"bench.q.{suffix}"
    admin = pika.BlockingConnection(pika.URLParameters(args.amqp))
    channel = admin.channel()
    channel.exchange_declare(exchange, "topic", durable=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, exchange, "#")
    outbox = Outbox(args.db, table=f"bench_{suffix}")
    body = b'{"order_id": 0, "total": 1999, "currency": "EUR", "lines": [1, 2, 3]}'
    raws, minimals, relays = [], [], []
    try:
        for round_ in range(1, args.rounds + 1):
            raw = raw_confirmed_rate(
                args.amqp, exchange, args.events, args.batch, body, same_properties
            )
            channel.queue_purge(queue)
            minimal = raw_confirmed_rate(
                args.amqp, exchange, args.events, args.batch, body, lambda _i: MINIMAL
            )
            channel.queue_purge(queue)
            minimals.append(minimal)
            # A fresh table each round: the last round's dead rows (and the
            # autovacuum they trigger) would slow this one.
            outbox.install()
            prefill(outbox, args.events)
            rate = relay_rate(outbox, args.amqp, exchange, args.events, args.batch)
            channel.queue_purge(queue)
            outbox.tables.metadata.drop_all(outbox.engine)
            raws.append(raw)
            relays.append(rate)
            print(
                f"round {round_}: raw {raw:8.0f} msg/s (minimal properties {minimal:8.0f})"
                f"   relay {rate:8.0f} events/s   ratio {rate / raw:.2f}"
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)
        admin.close()
    raw, rate = statistics.median(raws), statistics.median(relays)
    ratio = statistics.median(r / w for r, w in zip(relays, raws, strict=True))
    print(f"database: {outbox.dialect.name}, events: {args.events}, batch: {args.batch}")
    print(f"raw pika confirmed publish, the relay's properties (median): {raw:8.0f} msg/s")
    print(
        "raw pika confirmed publish, minimal shared properties (median): "
        f"{statistics.median(minimals):8.0f} msg/s"
    )
    print(f"relay PostgreSQL -> RabbitMQ (median): {rate:8.0f} events/s")
    print(f"ratio relay/raw (median of rounds): {ratio:.2f} (target >= 0.70)")


if __name__ == "__main__":
    main()
