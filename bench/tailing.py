"""What the log-tailing benches share: ``bench/wal.py`` (PostgreSQL), ``bench/binlog.py`` (MariaDB).

Both measure a log-tailing relay against polling in one run on one server:
the command line's sizes, the server (``--db``, or a private one removed
afterwards), the brokers (a no-op, or RabbitMQ on an exchange and queue of
the bench's own), a drain timed to the broker's N-th event, the
commit-to-broker latency of a steady producer, the bare lease loop's
ceiling, and the tables' rows that read the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from bench.bare_lease import bare_lease_rate
from bench.common import PAYLOAD
from outbox_core import Event, Outbox, Outcome
from outbox_core.brokers.base import Broker
from outbox_core.dialects.base.tailing.progress_row import progress_table
from tests.faults.private_servers import PrivateMariaDB, PrivatePostgres, started

#: Longest one measurement may take before the bench gives up on it.
TIMEOUT = 600.0
T = TypeVar("T")


class Database:
    """The server a bench measures: its URL, and an engine for statements outside any
    measured connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        # NullPool: no idle connection of the meter holds a backend open.
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)


S = TypeVar("S", bound=Database)


class Stopwatch(Broker):
    """Records when ``publish()`` first saw each event; answers ok (or asks ``inner``).

    ``on_total`` is called once, with the time, when ``total`` distinct events were seen.
    """

    def __init__(
        self,
        inner: Broker | None = None,
        total: int = 0,
        on_total: Callable[[float], None] | None = None,
    ) -> None:
        self.inner = inner
        self.total = total
        self.on_total = on_total
        self.received: dict[str, float] = {}
        self.done_at = 0.0

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        now = time.perf_counter()
        for event in events:
            self.received.setdefault(event.event_id, now)
        if self.total and not self.done_at and len(self.received) >= self.total:
            self.done_at = now
            if self.on_total is not None:
                self.on_total(now)
        if self.inner is not None:
            return self.inner.publish(events)
        return [Outcome.ok()] * len(events)

    def probe(self) -> str | None:
        return None if self.inner is None else self.inner.probe()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def new_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def alternating(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in their order in odd rounds, reversed in even ones."""
    return list(items) if round_ % 2 == 1 else list(reversed(items))


def drop_tables(outbox: Outbox) -> None:
    """The outbox's tables, and ``<table>_wal`` (made by ``install --source wal|binlog``)."""
    outbox.tables.metadata.drop_all(outbox.engine)
    progress_table(outbox.table).drop(outbox.engine, checkfirst=True)
    outbox.dispose()


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both benches take after ``--db`` and ``--broker``: sizes and rounds."""
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000, help="distinct ordering keys")
    parser.add_argument("--txn-events", type=int, default=1, help="events per transaction")
    parser.add_argument("--batch", type=int, default=500, help="relay batch size")
    parser.add_argument("--rate", type=float, default=200.0, help="latency: events per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="latency: seconds per mode")
    parser.add_argument("--poll", type=float, default=0.2, help="latency: poll interval (s)")
    parser.add_argument("--max-poll", type=float, default=1.0, help="latency: longest poll (s)")
    parser.add_argument("--rounds", type=int, default=3)


# ---------------------------------------------------------------------------- brokers


class Brokers:
    """No-op brokers, or the real RabbitMQ one on an exchange and queue of the bench's own."""

    def __init__(self, amqp: str | None) -> None:
        self.amqp = amqp
        self.exchange = new_name("bench.wal")
        self.queue = self.exchange + ".q"
        self.admin: Any = None
        if amqp is not None:
            import pika

            self.admin = pika.BlockingConnection(pika.URLParameters(amqp))
            channel = self.admin.channel()
            channel.exchange_declare(self.exchange, "topic", durable=True)
            channel.queue_declare(self.queue, durable=True)
            channel.queue_bind(self.queue, self.exchange, "#")
            self.channel = channel

    def make(self, real: bool) -> Broker | None:
        if not real:
            return None
        from outbox_core.brokers.rabbitmq import RabbitMQBroker

        assert self.amqp is not None
        return RabbitMQBroker.from_url(self.amqp, exchange=self.exchange)

    def purge(self) -> None:
        if self.admin is not None:
            self.channel.queue_purge(self.queue)

    def close(self) -> None:
        if self.admin is not None:
            self.channel.queue_delete(self.queue)
            self.channel.exchange_delete(self.exchange)
            self.admin.close()


@contextlib.contextmanager
def opened(
    db: str | None,
    private: Callable[[], PrivatePostgres | PrivateMariaDB],
    server: Callable[[str], S],
    amqp: str | None,
) -> Iterator[tuple[S, Brokers, str]]:
    """(server, brokers, where the server is): ``server`` of ``db``, or of a private one
    (``private()``, started here and removed on exit); the brokers of ``amqp``. All
    closed on exit."""
    with contextlib.ExitStack() as stack:
        if db is None:
            made = stack.enter_context(started(private()))
            url, where = made.url, f"a private server on port {made.port}"
        else:
            url, where = db, "the server given with --db"
        measured = server(url)
        stack.callback(measured.engine.dispose)
        brokers = Brokers(amqp)
        stack.callback(brokers.close)
        yield measured, brokers, where


# ---------------------------------------------------------------------------- measurements


@dataclass
class Drain:
    """One drain: its rate, and the log written while producing and while draining."""

    rate: float
    produce_rate: float
    produce_bytes: int
    drain_bytes: int


@dataclass
class Run(Generic[S]):
    """The run's settings, the server and brokers it measures, and the rounds' results."""

    server: S
    brokers: Brokers
    events: int
    keys: int
    batch: int
    txn_events: int
    results: dict[str, list[Any]] = field(default_factory=dict)

    def record(self, name: str, value: Any) -> None:
        self.results.setdefault(name, []).append(value)

    def lease_ceiling(self, table: str) -> float:
        """bench/bare_lease.py's loop on the raw driver: claim then fenced mark, a minimal
        ``table``."""
        payload = json.dumps(PAYLOAD).encode()
        probe = Outbox(self.server.url, table=table)
        try:
            return bare_lease_rate(
                probe.engine, self.events, self.batch, payload, probe.dialect.analyze
            )
        finally:
            probe.dispose()


def relay_to_total(runner: Any, broker: Stopwatch, kind: str) -> float:
    """Run ``runner`` on a thread until ``broker`` saw its total (then it is stopped);
    events/s from the start to the broker's last event."""
    broker.on_total = lambda _at: runner.stop()
    started = time.perf_counter()
    worker = threading.Thread(target=runner.run, kwargs={"install_signal_handlers": False})
    worker.start()
    worker.join(TIMEOUT)
    if worker.is_alive() or not broker.done_at:
        runner.stop()
        worker.join(30)
        raise SystemExit(f"{kind}: the broker saw {len(broker.received)} of {broker.total}")
    return broker.total / (broker.done_at - started)


@dataclass
class Steady:
    """A producer committing one event per transaction at ``rate`` for ``seconds``."""

    producer: Outbox
    topic: str
    keys: int
    rate: float
    seconds: float

    def latencies(self, runner: Any, broker: Stopwatch, kind: str) -> list[float]:
        """Milliseconds from each commit to ``publish()`` seeing it, ``runner`` on a thread
        (stopped on return; the tables are the caller's to drop)."""
        worker = threading.Thread(target=runner.run, kwargs={"install_signal_handlers": False})
        committed: dict[str, float] = {}
        try:
            worker.start()
            time.sleep(0.5)  # connected, listening or reading; polling settled
            self.produce(committed)
            deadline = time.perf_counter() + 15
            while len(broker.received) < len(committed) and time.perf_counter() < deadline:
                time.sleep(0.01)
        finally:
            runner.stop()
            worker.join(30)
        missing = [i for i in committed if i not in broker.received]
        if missing:
            raise SystemExit(f"latency {kind}: {len(missing)} events did not arrive")
        return [(broker.received[i] - t) * 1000 for i, t in committed.items()]

    def produce(self, committed: dict[str, float]) -> None:
        """Commit at the pace; ``committed``: each event's id, and when its commit returned."""
        next_at = time.perf_counter()
        end, i = next_at + self.seconds, 0
        while next_at < end:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            with self.producer.engine.begin() as conn:
                key = f"k{i % self.keys}"
                payload = dict(PAYLOAD, order_id=i)
                event_id = self.producer.enqueue(conn, self.topic, payload, key=key)
            committed[event_id] = time.perf_counter()
            next_at += 1.0 / self.rate
            i += 1


# ---------------------------------------------------------------------------- tables


def latency_table(results: Mapping[str, list[Any]], names: Mapping[str, str], width: int) -> None:
    """Section 2's rows: events, p50, p95, p99 and max (ms) of each mode's ``latency <mode>``
    results, the median over the rounds; ``names``: the modes' row names."""
    print(f"{'relay':<{width}} {'events':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7}")
    for mode, name in names.items():
        lats: list[list[float]] = results[f"latency {mode}"]
        print(
            f"{name:<{width}} {med([len(x) for x in lats]):>7.0f} "
            f"{med([percentile(x, 0.5) for x in lats]):>7.1f} "
            f"{med([percentile(x, 0.95) for x in lats]):>7.1f} "
            f"{med([percentile(x, 0.99) for x in lats]):>7.1f} "
            f"{med([max(x) for x in lats]):>7.1f}"
        )


D = TypeVar("D", bound=Drain)


def bytes_rows(
    n: int, drains: Mapping[str, list[D]], more: Callable[[list[D]], str] = lambda _runs: ""
) -> None:
    """Section 3's rows, log bytes per event: producing alone, then produce, drain and total
    beside each relay (the medians of its ``drains``; ``more``: columns after them)."""
    produce_only = [d.produce_bytes / n for runs in drains.values() for d in runs]
    print(f"{'producing alone (the inserts)':<40} {med(produce_only):>8.0f}")
    for label, runs in drains.items():
        print(
            f"{'produce + ' + label:<40} {med([d.produce_bytes / n for d in runs]):>8.0f} "
            f"{med([d.drain_bytes / n for d in runs]):>8.0f} "
            f"{med([(d.produce_bytes + d.drain_bytes) / n for d in runs]):>8.0f}" + more(runs)
        )
