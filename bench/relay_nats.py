"""Relay throughput PostgreSQL -> NATS JetStream against nats-py's best confirmed publishing.

Prints, in one run and with the same batch size:

1. raw: nats-py alone publishing the relay's messages (same subject, body and
   headers: ``Nats-Msg-Id``, ``Outbox-Key``, ``Outbox-Attempt``,
   ``Content-Type``) with ``publish_async``, a batch at a time, waiting for
   the batch's PubAcks (no database): the ceiling the ratio uses;
2. relay: events prefilled in the outbox table (100 keys), drained by one
   relay to the same stream (claim -> publish, acks -> mark sent), until all
   are sent;
3. the ratio relay / raw (target >= 0.7);
4. for reference, the same relay draining the same events to the memory
   broker: the database side alone, the most any broker's relay can reach.

    python bench/relay_nats.py --events 50000 --batch 500
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_until_sent
from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker
from outbox_core.brokers.nats import ATTEMPT_HEADER, KEY_HEADER, MSG_ID_HEADER, NatsBroker

PAYLOAD = {"order_id": 0, "total": 1999, "currency": "EUR", "lines": [1, 2, 3]}
BODY = b'{"order_id":0,"total":1999,"currency":"EUR","lines":[1,2,3]}'


async def raw_rate(url: str, subject: str, total: int, batch: int) -> float:
    """Messages/s for nats-py publishing ``batch`` messages, then awaiting their PubAcks."""
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=max(4000, batch))
    started = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(batch, total - sent)
        futures = []
        for i in range(sent, sent + n):
            headers = {
                "Content-Type": "application/json",
                KEY_HEADER: f"k{i % 100}",
                ATTEMPT_HEADER: "1",
                MSG_ID_HEADER: str(uuid.uuid4()),
            }
            futures.append(await js.publish_async(subject, BODY, headers=headers))
        for ack in await asyncio.gather(*futures):
            assert ack.seq
        sent += n
    elapsed = time.perf_counter() - started
    await nc.close()
    return total / elapsed


def prefill(outbox: Outbox, topic: str, total: int) -> None:
    with outbox.engine.begin() as conn:
        for i in range(total):
            outbox.enqueue(conn, topic, dict(PAYLOAD, order_id=i), key=f"k{i % 100}")


async def stream(url: str, name: str, subjects: list[str] | None) -> None:
    """Create the stream (``subjects``) or delete it (None)."""
    nc = await nats.connect(url)
    try:
        if subjects is None:
            await nc.jetstream().delete_stream(name)
        else:
            await nc.jetstream().add_stream(name=name, subjects=subjects)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:8]
    name, prefix = f"BENCH_{suffix.upper()}", f"bench.{suffix}"
    asyncio.run(stream(args.nats, name, [f"{prefix}.>"]))
    outbox = Outbox(args.db, table=f"bench_{suffix}")
    raws, relays, memories = [], [], []
    try:
        for round_ in range(1, args.rounds + 1):
            raw = asyncio.run(raw_rate(args.nats, f"{prefix}.raw", args.events, args.batch))
            outbox.install()
            prefill(outbox, f"{prefix}.relay", args.events)
            broker = NatsBroker.from_url(args.nats)
            relay = outbox.relay(broker, batch_size=args.batch, reap_interval=0, cleanup_after=0)
            rate = run_until_sent(relay, args.events, timeout=600)
            relay.close()
            outbox.tables.metadata.drop_all(outbox.engine)
            outbox.install()
            prefill(outbox, f"{prefix}.relay", args.events)
            memory = outbox.relay(MemoryBroker(), batch_size=args.batch, reap_interval=0)
            memories.append(run_until_sent(memory, args.events, timeout=600))
            memory.close()
            outbox.tables.metadata.drop_all(outbox.engine)
            raws.append(raw)
            relays.append(rate)
            print(
                f"round {round_}: raw {raw:8.0f} msg/s   relay {rate:8.0f} events/s"
                f"   ratio {rate / raw:.2f}"
                f"   (memory broker {memories[-1]:8.0f} events/s)"
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        asyncio.run(stream(args.nats, name, None))
    ratio = statistics.median(r / w for r, w in zip(relays, raws, strict=True))
    print(f"database: {outbox.dialect.name}, events: {args.events}, batch: {args.batch}")
    print(f"raw nats-py publish_async + PubAcks (median): {statistics.median(raws):8.0f} msg/s")
    print(f"relay -> NATS JetStream (median): {statistics.median(relays):8.0f} events/s")
    print(f"ratio relay/raw (median of rounds): {ratio:.2f} (target >= 0.70)")
    database_side = statistics.median(memories)
    print(f"relay -> memory broker, the database side (median): {database_side:8.0f} events/s")


if __name__ == "__main__":
    main()
