"""What the many-outboxes bench (``bench/many_outboxes.py``) measures with: where its
outboxes live, the statements a relay's engine sends (by kind), and two clocks: a
broker that notes arrivals, a bare ``LISTEN``."""

from __future__ import annotations

import collections
import gc
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outbox_core import Event, Outbox, Outcome
from outbox_core.brokers.base import Broker
from outbox_core.fleet import FleetRelay
from outbox_core.message import CycleResult
from outbox_core.relay import Relay
from outbox_core.relay.observers import OnCycle


class Place:
    """Where the bench's outboxes live: a database of their own (PostgreSQL), or databases
    named ``<prefix>_<hex>_...`` (MariaDB/MySQL, whose schemas are databases)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.tag = f"{prefix}_{uuid.uuid4().hex[:6]}"
        given = sa.make_url(url)
        self.postgres = given.get_backend_name() == "postgresql"
        self.admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        if self.postgres:
            with self.admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{self.tag}"'))
            given = given.set(database=self.tag)
        self.url = given.render_as_string(hide_password=False)
        # No pool: a connection of its own would count among the relays' (and linger).
        self.engine = sa.create_engine(self.url, poolclass=sa.NullPool)
        self.made: set[str] = set()

    def names(self, kind: str, n: int) -> list[str]:
        """``n`` schema names of one kind (``pattern(kind)`` matches them and no others)."""
        return [f"{self.tag}_{kind}{i:03d}" for i in range(n)]

    def pattern(self, kind: str) -> str:
        return f"{self.tag}_{kind}*"

    def create(self, names: Sequence[str]) -> list[Outbox]:
        """Fresh schemas with the toolkit's tables, sharing one engine."""
        outboxes = [Outbox(self.engine, schema=name) for name in names]
        with self.engine.begin() as conn:
            for outbox in outboxes:
                conn.execute(sa.schema.CreateSchema(outbox.tables.outbox.schema or ""))
                outbox.tables.metadata.create_all(conn, checkfirst=False)
        self.made.update(names)
        return outboxes

    def drop(self, names: Sequence[str]) -> None:
        with self.engine.begin() as conn:
            for name in names:
                conn.execute(sa.schema.DropSchema(name, cascade=self.postgres, if_exists=True))
        self.made.difference_update(names)

    def xacts(self) -> int | None:
        """Transactions the server counted in this database (PostgreSQL), else None."""
        if not self.postgres:
            return None
        query = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :d"
        with self.admin.connect() as conn:
            return int(conn.execute(sa.text(query), {"d": self.tag}).scalar_one())

    def backends(self) -> int | None:
        """Connections open to this database now (PostgreSQL), else None."""
        if not self.postgres:
            return None
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = :d"
        with self.admin.connect() as conn:
            return int(conn.execute(sa.text(query), {"d": self.tag}).scalar_one())

    def quiet(self, timeout: float = 30.0) -> None:
        """Wait until no connection to this database is left (their counts reported)."""
        deadline = time.monotonic() + timeout
        while self.backends() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.engine.dispose()
        if self.postgres:
            with self.admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.tag}" WITH (FORCE)'))
        elif self.made:
            self.drop(sorted(self.made))
        self.admin.dispose()


def kind_of(statement: str) -> str:
    """What a relay's statement is for, from its text."""
    s = " ".join(statement.lower().split())
    if "information_schema" in s:
        return "discovery"
    if "exists" in s and " as kind" in s:  # one SELECT per outbox, UNION ALL
        return "probe"
    if "_presence" in s:
        return "presence"
    if "lease_until <" in s:
        return "reap"
    if "sent_at <" in s or "processed_at <" in s or s.startswith("delete"):
        return "cleanup"
    if "for update" in s or "returning" in s:
        return "claim"
    return "other"


class Counter:
    """Statements (by kind) and transactions the client sends, through engine events."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def attach(self, engine: sa.Engine) -> None:
        def statement(conn: Any, cursor: Any, text: str, *rest: Any) -> None:
            with self._lock:
                self.counts[kind_of(text)] += 1

        def ended(conn: Any) -> None:
            with self._lock:
                self.counts["transactions"] += 1

        def checkout(*args: Any) -> None:
            # pool_pre_ping: a SELECT 1 (and its transaction) the statement events miss
            with self._lock:
                self.counts["checkouts"] += 1

        sa.event.listen(engine, "checkout", checkout)
        sa.event.listen(engine, "before_cursor_execute", statement)
        sa.event.listen(engine, "commit", ended)
        sa.event.listen(engine, "rollback", ended)

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self.counts)


class Stopwatch(Broker):
    """Accepts every batch; notes when each fresh event arrived and the backlog's span."""

    def __init__(self) -> None:
        self.fresh: dict[str, float] = {}
        self.backlog = 0
        self.first = self.last = 0.0

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        now = time.perf_counter()
        for event in events:
            if event.topic == "bench.quiet":
                self.fresh.setdefault(event.event_id, now)
            else:
                self.first = self.first or now
                self.last = now
                self.backlog += 1
        return [Outcome.ok()] * len(events)


class Listen:
    """A bare psycopg connection LISTENing on one channel: when each notification came."""

    def __init__(self, engine: sa.Engine, channel: str) -> None:
        import psycopg
        from psycopg import sql

        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        cparams.pop("context", None)  # the driver's own adapters
        self.conn = psycopg.connect(*cargs, autocommit=True, **cparams)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self.received: list[float] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping:
            for _ in self.conn.notifies(timeout=0.2):
                self.received.append(time.perf_counter())

    def take(self, n: int, timeout: float = 5.0) -> list[float] | None:
        """The times of the ``n`` notifications since the last take (None: not as many)."""
        deadline = time.monotonic() + timeout
        while len(self.received) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        taken, self.received = self.received, []
        return taken if len(taken) == n else None

    def close(self) -> None:
        """Stop listening; close the connection."""
        self.stopping = True
        self.thread.join(5)
        self.conn.close()


def steady_rate(relay: Relay | FleetRelay, total: int, *, skip: float = 0.1) -> float:
    """``relay.run()`` until ``total`` events are sent; events/s once the first ``skip`` of
    them are out.

    The first events carry the ramp-up of the relay's pipeline. The callers
    load the events due after the relay's own start (its side tasks, and for
    a fleet the first beat in each outbox's presence table), so that is not
    measured; the compiling of each outbox's statements in its first batches
    is. The rate is what a relay that has been running drains a backlog at,
    measured alike for both.
    """
    sent = 0
    marks: dict[str, float] = {}

    def count(result: CycleResult) -> None:
        nonlocal sent
        sent += result.sent
        now = time.perf_counter()
        if sent >= skip * total and "from" not in marks:
            marks["from"], marks["sent"] = now, sent
        if sent >= total and "to" not in marks:
            marks["to"] = now
            relay.stop()

    relay.observers.append(OnCycle(count))
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    worker = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    worker.start()
    worker.join(600)
    if sent < total:
        relay.stop()
        raise SystemExit(f"relay sent {sent} of {total}")
    if marks["sent"] >= total:  # one batch took them all (tiny runs): no steady part
        return total / (marks["to"] - started)
    return (total - marks["sent"]) / (marks["to"] - marks["from"])
