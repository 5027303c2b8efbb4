"""``outbox demo``: the guarantees on a throw-away SQLite file, no server needed.

Orders and their events are written in business transactions (every seventh
rolled back on purpose) while two ordered relays publish to the memory broker.
Relay A dies in the middle of a batch, after publishing part of it and before
marking anything: its leases expire and relay B re-claims and delivers those
events. The summary counts what arrived; the demo fails unless nothing was
lost, nothing rolled back was published and every key kept its order.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox_core.brokers.base import Broker
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import Event, Outcome
from outbox_core.outbox import Outbox
from outbox_core.relay import Relay


class SimulatedCrash(BaseException):
    """Ends a relay thread as abruptly as SIGKILL ends a process: nothing is settled."""


class CrashingBroker(Broker):
    """Publishes half of its first batch of two or more events, then dies."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.crashed_size = 0
        self.crashed = threading.Event()

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Publish, or publish half the batch and crash."""
        if len(events) < 2:
            return self.inner.publish(events)
        self.inner.publish(events[: len(events) // 2])
        self.crashed_size = len(events)
        self.crashed.set()
        raise SimulatedCrash(f"relay A killed mid-batch after {len(events) // 2} of {len(events)}")


@dataclass
class DemoReport:
    """What the demo counted."""

    committed: int = 0
    rolled_back: int = 0
    delivered: int = 0
    duplicates: int = 0
    lost: int = 0
    rolled_back_published: int = 0
    order_violations: int = 0
    crashed_batch: int = 0
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every guarantee held."""
        return (
            self.crashed_batch > 0
            and not self.errors
            and self.lost == 0
            and self.rolled_back_published == 0
            and self.order_violations == 0
            and self.delivered == self.committed
        )

    def render(self) -> str:
        """The summary as text."""
        rows = [
            ("committed events", self.committed),
            ("rolled back (never to be published)", self.rolled_back),
            ("delivered (distinct)", self.delivered),
            ("duplicates (after the crash)", self.duplicates),
            ("events in the crashed batch", self.crashed_batch),
            ("lost", self.lost),
            ("rolled back but published", self.rolled_back_published),
            ("per-key order violations", self.order_violations),
        ]
        width = max(len(r[0]) for r in rows)
        out = [*self.lines, ""]
        out += [f"  {label:<{width}}  {value}" for label, value in rows]
        out.append(f"  {'time':<{width}}  {self.seconds:.1f}s")
        out.append("")
        out.append("OK: every guarantee held" if self.ok else "FAILED: a guarantee was broken")
        return "\n".join(out)


def _relay_thread(relay: Relay, errors: list[BaseException]) -> threading.Thread:
    def target() -> None:
        try:
            relay.run(install_signal_handlers=False)
        except SimulatedCrash:
            # Drop the connection without releasing anything, like a killed process.
            relay.connections.drop()
        except BaseException as exc:  # reported in the summary
            errors.append(exc)

    thread = threading.Thread(target=target, name=relay.name, daemon=True)
    thread.start()
    return thread


@dataclass
class _Written:
    """What the business transactions wrote: committed events and rolled back ones."""

    #: event_id -> (key, sequence in key)
    committed: dict[str, tuple[str, int]] = field(default_factory=dict)
    rolled_back: set[str] = field(default_factory=set)


def _orders_table(outbox: Outbox) -> sa.Table:
    """The business table the demo's transactions write to, created on the outbox's database."""
    meta = sa.MetaData()
    orders = sa.Table(
        "orders",
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("customer", sa.String(50), nullable=False),
    )
    meta.create_all(outbox.engine)
    return orders


def _relays(outbox: Outbox, queue: MemoryQueue) -> tuple[CrashingBroker, Relay, Relay]:
    """Relay A (its broker crashes mid-batch) and relay B, both ordered, on one queue."""
    crasher = CrashingBroker(MemoryBroker(queue))
    knobs: dict[str, Any] = {
        "ordered": True,
        "batch_size": 20,
        "lease": 1.0,  # short, so the crashed relay's claims come back quickly
        "reap_interval": 0.25,
        "poll_interval": 0.02,
        "max_poll_interval": 0.2,
    }
    relay_a = outbox.relay(crasher, name="relay-A", **knobs)
    relay_b = outbox.relay(MemoryBroker(queue), name="relay-B", **knobs)
    return crasher, relay_a, relay_b


def _write_orders(
    outbox: Outbox, orders: sa.Table, events: int, keys: int, start_relays: Callable[[], None]
) -> _Written:
    """Write ``events`` orders with their events, every seventh rolled back.

    ``start_relays`` is called a third of the way in, so the relays start on a
    backlog and keep up with the rest.
    """
    written = _Written()
    next_seq: dict[str, int] = {}
    for i in range(events):
        if i == events // 3:
            start_relays()
        key = f"customer-{i % keys}"
        try:
            with outbox.engine.begin() as conn:
                conn.execute(orders.insert().values(id=i + 1, customer=key))
                seq = next_seq.get(key, 0)
                event_id = outbox.enqueue(
                    conn, "order.created", {"order_id": i + 1, "seq": seq}, key=key
                )
                if i % 7 == 3:
                    written.rolled_back.add(event_id)
                    raise _Rollback
            written.committed[event_id] = (key, seq)
            next_seq[key] = seq + 1
        except _Rollback:
            pass
    return written


def _wait_for_delivery(
    queue: MemoryQueue, expected: Iterable[str], errors: list[BaseException], timeout: float
) -> None:
    """Until every expected event arrived, a relay failed, or ``timeout`` passed."""
    wanted = set(expected)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not errors:
        if {e.event_id for e in queue.snapshot()} >= wanted:
            return
        time.sleep(0.05)


def _count(report: DemoReport, delivered: Sequence[Event], written: _Written) -> None:
    """Fill in what arrived: distinct, duplicates, lost, rolled back, per-key order."""
    committed, rolled_back = written.committed, written.rolled_back
    report.committed = len(committed)
    report.rolled_back = len(rolled_back)
    seen: set[str] = set()
    last_seq: dict[str, int] = {}
    for event in delivered:
        if event.event_id in rolled_back:
            report.rolled_back_published += 1
        if event.event_id in seen:
            report.duplicates += 1
            continue
        seen.add(event.event_id)
        key, seq = committed.get(event.event_id, (event.key or "", -1))
        if seq <= last_seq.get(key, -1):
            report.order_violations += 1
        last_seq[key] = seq
    report.delivered = len(seen & committed.keys())
    report.lost = len(committed.keys() - seen)


def run_demo(
    events: int = 400, keys: int = 12, directory: str | None = None, timeout: float = 120.0
) -> DemoReport:
    """Run the demo and return its report."""
    started = time.monotonic()
    report = DemoReport()
    queue = MemoryQueue("demo")
    errors: list[BaseException] = []
    with tempfile.TemporaryDirectory(prefix="outbox-demo-", dir=directory) as tmp:
        db = Path(tmp) / "demo.sqlite3"
        outbox = Outbox(f"sqlite:///{db}")
        outbox.install()
        report.lines.append(f"database: {db} (SQLite, WAL mode)")
        orders = _orders_table(outbox)
        crasher, relay_a, relay_b = _relays(outbox, queue)
        threads: list[threading.Thread] = []

        def start_relays() -> None:
            # Relay A starts alone on a backlog, so its first batch is a full
            # one; it dies in the middle of it, then relay B starts.
            threads.append(_relay_thread(relay_a, errors))
            crasher.crashed.wait(timeout)
            threads.append(_relay_thread(relay_b, errors))

        written = _write_orders(outbox, orders, events, keys, start_relays)
        assert len(threads) == 2
        _wait_for_delivery(queue, written.committed, errors, timeout)
        relay_b.stop()
        relay_a.stop()
        for thread in reversed(threads):
            thread.join(10)
        outbox.dispose()

    _count(report, queue.snapshot(), written)
    report.crashed_batch = crasher.crashed_size
    report.lines.append(
        "relay A: "
        + (
            "killed mid-batch; its leases expired and relay B took over"
            if crasher.crashed.is_set()
            else "finished without crashing"
        )
    )
    report.errors = [f"relay error: {exc!r}" for exc in errors]
    report.lines.extend(report.errors)
    report.seconds = time.monotonic() - started
    return report


class _Rollback(Exception):
    """Raised inside a business transaction to roll it back on purpose."""
