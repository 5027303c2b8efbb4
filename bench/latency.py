"""Commit -> broker receipt latency at a steady event rate, per wake-up mode.

Modes (each a fresh relay in this process, publishing to the memory broker):

* ``notify``: PostgreSQL only; producers ``NOTIFY`` at commit, the relay ``LISTEN``s;
* ``local``: producer and relay share the ``Outbox`` object: an after-commit signal;
* ``poll``: neither; the relay polls (adaptive interval, ``--poll`` to ``--max-poll``).

Prints p50 / p95 / p99 / max in milliseconds. Targets on PostgreSQL with NOTIFY:
p50 <= 10 ms, p99 <= 50 ms.

    python bench/latency.py --rate 200 --seconds 10
    python bench/latency.py --db mysql+pymysql://root@127.0.0.1:3306/test --modes local,poll
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_core import Event, Outbox, Outcome
from outbox_core.brokers.base import Broker


class Stopwatch(Broker):
    """Records when each event reached the broker."""

    def __init__(self) -> None:
        self.received: dict[str, float] = {}

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        now = time.perf_counter()
        for event in events:
            self.received.setdefault(event.event_id, now)
        return [Outcome.ok()] * len(events)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(
    url: str, table: str, mode: str, rate: float, seconds: float, poll: float, max_poll: float
) -> list[float]:
    relay_outbox = Outbox(url, table=table, notify=mode == "notify")
    producer = (
        relay_outbox if mode == "local" else Outbox(url, table=table, notify=mode == "notify")
    )
    broker = Stopwatch()
    relay = relay_outbox.relay(
        broker,
        batch_size=100,
        notify=mode == "notify",
        poll_interval=poll,
        max_poll_interval=max_poll,
        reap_interval=0,
        cleanup_after=0,
    )
    worker = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    worker.start()
    time.sleep(0.5)  # listener connected, poll interval settled at its maximum
    committed: dict[str, float] = {}
    interval = 1.0 / rate
    next_at = time.perf_counter()
    end = next_at + seconds
    while next_at < end:
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with producer.engine.begin() as conn:
            event_id = producer.enqueue(conn, "bench.latency", {"at": next_at})
        committed[event_id] = time.perf_counter()
        next_at += interval
    deadline = time.perf_counter() + 10
    while len(broker.received) < len(committed) and time.perf_counter() < deadline:
        time.sleep(0.01)
    relay.stop()
    worker.join(10)
    missing = len(committed) - len(broker.received)
    if missing:
        raise SystemExit(f"{mode}: {missing} events did not arrive")
    relay_outbox.dispose()
    producer.dispose()
    return [(broker.received[i] - t) * 1000 for i, t in committed.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--rate", type=float, default=200.0, help="events per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--modes", default="notify,local,poll")
    parser.add_argument("--poll", type=float, default=0.2, help="poll interval (s)")
    parser.add_argument("--max-poll", type=float, default=1.0, help="longest poll interval (s)")
    args = parser.parse_args()

    table = f"bench_lat_{uuid.uuid4().hex[:8]}"
    setup = Outbox(args.db, table=table)
    setup.install()
    modes = [m for m in args.modes.split(",") if m]
    if setup.dialect.name != "postgresql":
        modes = [m for m in modes if m != "notify"]
    print(f"database: {setup.dialect.name}, {args.rate:.0f} events/s for {args.seconds:.0f}s")
    print(f"{'mode':<8} {'events':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    try:
        for mode in modes:
            lat = run_mode(args.db, table, mode, args.rate, args.seconds, args.poll, args.max_poll)
            print(
                f"{mode:<8} {len(lat):>7} {statistics.median(lat):>8.1f} "
                f"{percentile(lat, 0.95):>8.1f} {percentile(lat, 0.99):>8.1f} {max(lat):>8.1f}"
            )
    finally:
        setup.tables.metadata.drop_all(setup.engine)
        setup.dispose()


if __name__ == "__main__":
    main()
