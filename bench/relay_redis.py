"""Relay throughput PostgreSQL -> Redis Streams against redis-py's best pipelined XADD.

Prints, in one run and with the same batch size:

1. raw: redis-py alone adding the relay's entries (same stream, same fields:
   ``event_id``, ``topic``, ``key``, ``payload``, ``headers``) with one
   non-transactional pipeline of ``XADD`` per batch (no database, no
   deduplication): the ceiling the ratio uses;
2. relay: events prefilled in the outbox table (100 keys), drained by one
   relay to the same stream (claim -> one Lua script per batch that also
   deduplicates by event id -> mark sent), until all are sent;
3. the ratio relay / raw (target >= 0.7);
4. for reference, the same relay draining the same events to the memory
   broker: the database side alone, the most any broker's relay can reach.

    python bench/relay_redis.py --events 50000 --batch 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_until_sent
from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker
from outbox_core.brokers.redis import DEDUP_PREFIX, RedisBroker

PAYLOAD = {"order_id": 0, "total": 1999, "currency": "EUR", "lines": [1, 2, 3]}
BODY = b'{"order_id":0,"total":1999,"currency":"EUR","lines":[1,2,3]}'


def raw_rate(client: redis.Redis, stream: str, total: int, batch: int) -> float:
    """Entries/s for redis-py pipelining ``batch`` XADDs and reading their answers."""
    started = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(batch, total - sent)
        pipe = client.pipeline(transaction=False)
        for i in range(sent, sent + n):
            fields = {
                "event_id": str(uuid.uuid4()),
                "topic": "bench.relay",
                "key": f"k{i % 100}",
                "payload": BODY,
                "headers": b"{}",
            }
            pipe.xadd(stream, fields)  # type: ignore[arg-type]
        assert all(pipe.execute())
        sent += n
    return total / (time.perf_counter() - started)


def prefill(outbox: Outbox, total: int) -> None:
    with outbox.engine.begin() as conn:
        for i in range(total):
            outbox.enqueue(conn, "bench.relay", dict(PAYLOAD, order_id=i), key=f"k{i % 100}")


def forget(client: redis.Redis, stream: str) -> None:
    """Delete the stream and the dedup keys of its entries."""
    ids = [f[b"event_id"].decode() for _, f in client.xrange(stream) if b"event_id" in f]
    for start in range(0, len(ids), 1000):
        client.delete(*[DEDUP_PREFIX + i for i in ids[start : start + 1000]])
    client.delete(stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:8]
    raw_stream, relay_stream = f"bench.{suffix}.raw", f"bench.{suffix}.relay"
    client = redis.Redis.from_url(args.redis)
    outbox = Outbox(args.db, table=f"bench_{suffix}")
    raws, relays, memories = [], [], []
    try:
        for round_ in range(1, args.rounds + 1):
            raw = raw_rate(client, raw_stream, args.events, args.batch)
            client.delete(raw_stream)
            outbox.install()
            prefill(outbox, args.events)
            broker = RedisBroker.from_url(args.redis, stream=relay_stream)
            relay = outbox.relay(broker, batch_size=args.batch, reap_interval=0, cleanup_after=0)
            rate = run_until_sent(relay, args.events, timeout=600)
            relay.close()
            outbox.tables.metadata.drop_all(outbox.engine)
            forget(client, relay_stream)
            outbox.install()
            prefill(outbox, args.events)
            memory = outbox.relay(MemoryBroker(), batch_size=args.batch, reap_interval=0)
            memories.append(run_until_sent(memory, args.events, timeout=600))
            memory.close()
            outbox.tables.metadata.drop_all(outbox.engine)
            raws.append(raw)
            relays.append(rate)
            print(
                f"round {round_}: raw {raw:8.0f} entries/s   relay {rate:8.0f} events/s"
                f"   ratio {rate / raw:.2f}"
                f"   (memory broker {memories[-1]:8.0f} events/s)"
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        client.delete(raw_stream)
        forget(client, relay_stream)
        client.close()
    ratio = statistics.median(r / w for r, w in zip(relays, raws, strict=True))
    print(f"database: {outbox.dialect.name}, events: {args.events}, batch: {args.batch}")
    print(f"raw redis-py pipelined XADD (median): {statistics.median(raws):8.0f} entries/s")
    relayed = statistics.median(relays)
    print(f"relay -> Redis Streams, deduplicated (median): {relayed:8.0f} events/s")
    print(f"ratio relay/raw (median of rounds): {ratio:.2f} (target >= 0.70)")
    database_side = statistics.median(memories)
    print(f"relay -> memory broker, the database side (median): {database_side:8.0f} events/s")


if __name__ == "__main__":
    main()
