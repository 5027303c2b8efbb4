"""Relay throughput PostgreSQL -> Kafka against confluent-kafka's own best confirmed producing.

Prints, in one run, per round:

1. raw: confluent-kafka's Producer alone (no database), idempotent with
   ``acks=all`` as the relay's, producing the same records (key, the
   ``event_id`` and ``content-type`` headers, the same JSON value), each
   counted only once its delivery report says delivered; twice: everything
   produced, then one ``flush()`` (the client at its best: the ceiling the
   ratio uses), and a batch at a time with a flush per batch (the relay's
   rhythm, for reference);
2. relay: events prefilled in the outbox table, drained by one relay
   (claim -> produce and wait for the delivery reports -> mark sent);
3. relay to the memory broker on the same prefilled table: the database's
   share, the ceiling no broker can lift on this machine;
4. the ratios relay / raw best (target >= 0.7) and relay / memory relay.

Without ``--bootstrap`` the cluster is librdkafka's mock cluster in this
process (``tests/kafka_mock.py``): it shares the CPU with both sides.

    python bench/relay_kafka.py --events 50000 --batch 500
    python bench/relay_kafka.py --bootstrap kafka-1:9092 --events 200000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datetime import UTC, datetime

from bench.common import PAYLOAD, bulk_prefill, run_until_sent
from outbox_core import Outbox
from outbox_core.brokers.kafka import KafkaBroker
from outbox_core.brokers.kafka.mapping import build_record
from outbox_core.brokers.kafka.options import KafkaOptions, producer_config
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import Event

KEYS = 1000


def records(total: int, topic: str) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """The records the relay sends for ``total`` events, built the relay's way, before timing."""
    made = []
    now = datetime.now(UTC)
    options = KafkaOptions(topic=topic)
    for i in range(total):
        event = Event(
            id=i,
            event_id=str(uuid.uuid4()),
            topic=topic,
            key=f"k{i % KEYS}",
            payload=dict(PAYLOAD, order_id=i),
            headers={},
            attempts=1,
            created_at=now,
            token="",
        )
        record = build_record(event, options, topic)
        assert record.key is not None
        made.append((record.key, record.value, record.headers))  # type: ignore[arg-type]
    return made


def raw_rate(bootstrap: str, topic: str, total: int, batch: int | None) -> float:
    """Records/s delivered by confluent-kafka alone; ``batch`` None: one flush at the end."""
    config = producer_config(bootstrap, KafkaOptions(), {})
    producer = Producer(config)
    producer.list_topics(timeout=10)  # connected before the clock starts
    made = records(total, topic)
    delivered = 0

    def report(err: object, _msg: object) -> None:
        nonlocal delivered
        if err is not None:
            raise RuntimeError(f"delivery failed in the raw benchmark: {err}")
        delivered += 1

    step = batch or total
    started = time.perf_counter()
    for start in range(0, total, step):
        for key, value, headers in made[start : start + step]:
            while True:
                try:
                    producer.produce(topic, value, key, headers=headers, on_delivery=report)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.flush()
    elapsed = time.perf_counter() - started
    if delivered != total:
        raise SystemExit(f"raw: {delivered} of {total} delivered")
    return total / elapsed


def relay_rate(outbox: Outbox, url: str, topic: str, total: int, batch: int) -> float:
    """Events/s for ``Relay.run()`` (pipelined) draining ``total`` prefilled events."""
    broker = KafkaBroker.from_url(url, topic=topic)
    relay = outbox.relay(broker, batch_size=batch, reap_interval=0, cleanup_after=0)
    try:
        return run_until_sent(relay, total, timeout=600)
    finally:
        relay.close()


def memory_rate(outbox: Outbox, total: int, batch: int) -> float:
    """Events/s for the same relay to the in-process memory broker (the database's ceiling)."""
    relay = outbox.relay(
        MemoryBroker(MemoryQueue(f"bench-{uuid.uuid4().hex[:8]}")),
        batch_size=batch,
        reap_interval=0,
        cleanup_after=0,
    )
    try:
        return run_until_sent(relay, total, timeout=600)
    finally:
        relay.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--bootstrap", help="host:port,... of a Kafka (default: a mock cluster)")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    cluster = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        from tests.kafka_mock import MockCluster

        cluster = MockCluster(3)
        bootstrap = cluster.bootstrap
    suffix = uuid.uuid4().hex[:8]
    outbox = Outbox(args.db, table=f"bench_{suffix}")
    best, batched, relays, memories = [], [], [], []
    try:
        for round_ in range(1, args.rounds + 1):
            raw = raw_rate(bootstrap, f"bench.raw.{suffix}", args.events, None)
            per_batch = raw_rate(bootstrap, f"bench.batch.{suffix}", args.events, args.batch)
            # A fresh table each round, as bench/relay_rabbitmq.py does.
            outbox.install()
            bulk_prefill(outbox, args.events, keys=KEYS)
            rate = relay_rate(
                outbox, f"kafka://{bootstrap}", f"bench.relay.{suffix}", args.events, args.batch
            )
            outbox.tables.metadata.drop_all(outbox.engine)
            outbox.install()
            bulk_prefill(outbox, args.events, keys=KEYS)
            memory = memory_rate(outbox, args.events, args.batch)
            outbox.tables.metadata.drop_all(outbox.engine)
            memories.append(memory)
            best.append(raw)
            batched.append(per_batch)
            relays.append(rate)
            print(
                f"round {round_}: raw best {raw:8.0f} msg/s (flush per batch {per_batch:8.0f})"
                f"   relay {rate:8.0f} events/s   ratio {rate / raw:.2f}"
                f"   (memory broker relay {memory:8.0f}, ratio {rate / memory:.2f})",
                flush=True,
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        if cluster is not None:
            cluster.close()
    ratio = statistics.median(r / w for r, w in zip(relays, best, strict=True))
    where = args.bootstrap or "librdkafka mock cluster (3 brokers, in process)"
    print(f"database: {outbox.dialect.name}, Kafka: {where}")
    print(f"events: {args.events}, batch: {args.batch}, keys: {KEYS}")
    print(f"raw confluent-kafka, one flush (median): {statistics.median(best):8.0f} msg/s")
    print(f"raw confluent-kafka, flush per batch (median): {statistics.median(batched):8.0f} msg/s")
    print(f"relay PostgreSQL -> Kafka (median): {statistics.median(relays):8.0f} events/s")
    print(f"ratio relay/raw best (median of rounds): {ratio:.2f} (target >= 0.70)")
    share = statistics.median(r / m for r, m in zip(relays, memories, strict=True))
    print(f"relay to the memory broker (median): {statistics.median(memories):8.0f} events/s")
    print(f"ratio Kafka relay/memory relay (median of rounds): {share:.2f}")


if __name__ == "__main__":
    main()
