"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import gc
import resource
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_core import CycleResult, Event, Outbox, Outcome, Relay
from outbox_core.brokers.base import Broker
from outbox_core.partitions import partition_of
from outbox_core.relay import OnCycle

PAYLOAD = {"order_id": 0, "total": 1999, "currency": "EUR", "lines": [1, 2, 3]}


class Accept(Broker):
    """A broker that answers ok to every event and keeps none: the database side alone.

    Unlike the memory broker it holds no event once the batch is settled, as
    a broker on the network does not (a queue of every event relayed would
    grow the garbage collector's work with the drain).
    """

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Accept the batch."""
        return [Outcome.ok()] * len(events)


def bulk_prefill(
    outbox: Outbox,
    total: int,
    keys: int = 1000,
    chunk: int = 10_000,
    due_in: float = 0.0,
    due_at: datetime | None = None,
) -> float:
    """Insert ``total`` pending events with multi-row INSERTs, due in ``due_in`` s (or at
    ``due_at``, aware UTC); events/s."""
    bind = outbox.dialect.storage.bind_time
    now = datetime.now(UTC).replace(tzinfo=None)
    when = now + timedelta(seconds=due_in) if due_at is None else due_at.replace(tzinfo=None)
    now, due = bind(now), bind(when)
    started = time.perf_counter()
    for start in range(0, total, chunk):
        ids = [str(uuid.uuid4()) for _ in range(start, min(start + chunk, total))]
        rows = [
            {
                "event_id": ids[i - start],
                "topic": "bench.event",
                "key": f"k{i % keys}",
                "key_partition": partition_of(f"k{i % keys}", ids[i - start]),
                "payload": dict(PAYLOAD, order_id=i),
                "state": 0,
                "attempts": 0,
                "available_at": due,
                "created_at": now,
            }
            for i in range(start, min(start + chunk, total))
        ]
        with outbox.engine.begin() as conn:
            conn.execute(outbox.table.insert(), rows)
    return total / (time.perf_counter() - started)


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def run_until_sent(relay: Relay, total: int, timeout: float = 3600.0) -> float:
    """Run ``relay.run()`` (pipelined) until ``total`` events are sent; returns events/s."""
    sent = 0
    done_at = 0.0

    def count(result: CycleResult) -> None:
        nonlocal sent, done_at
        sent += result.sent
        if sent >= total and not done_at:
            done_at = time.perf_counter()
            relay.stop()

    relay.observers.append(OnCycle(count))
    # As ``outbox relay`` does before run(): what is alive now stays out of
    # the collector's full passes.
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    worker = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    worker.start()
    worker.join(timeout)
    if sent < total:
        relay.stop()
        raise SystemExit(f"relay sent {sent} of {total}")
    return total / (done_at - started)
