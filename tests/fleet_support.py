"""What the live tests of many outboxes (issue #39) share: tenants, a producer, relays.

* :class:`Tenants`: ``N`` PostgreSQL schemas and ``M`` MariaDB databases of the
  test's own, each with an installed outbox, all matching one ``--schemas``
  pattern; dropped afterwards.
* :class:`Producer`: commits events into the tenants' outboxes (and rolls some
  transactions back), each key's events numbered in commit order; keys are
  ``<outbox>/k<n>`` so a consumer knows the outbox each event came from.
* :func:`arrivals` and :class:`Check`: what a RabbitMQ consumer
  (:class:`tests.chaos.test_chaos.Consumer`) received, stamped with the
  arrival time, and the verdict: lost, duplicates, per-key order, rolled-back
  events that leaked.
* :func:`fleet_args`: the ``outbox relay`` command line over the tenants.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox_core import Outbox, State
from tests.chaos.test_chaos import Consumer
from tests.contract.broker_fixtures import RabbitState

#: The topic every fleet test event has (the test's queue is bound to ``fleet.#``).
TOPIC = "fleet.event"


class Tenants:
    """PostgreSQL schemas and MariaDB databases of the test's own, each an installed outbox.

    Names are ``h5_<random>_t<nn>`` (PostgreSQL) and ``h5_<random>_tm<n>``
    (MariaDB), so :attr:`pattern` names them all and nothing of another run.
    """

    def __init__(self, pg_url: str, mysql_url: str | None, *, pg: int, maria: int) -> None:
        self.prefix = f"h5_{uuid.uuid4().hex[:6]}"
        #: The ``--schemas`` pattern naming every tenant (on every server).
        self.pattern = f"{self.prefix}_t*"
        self.pg_url = pg_url
        self.mysql_url = mysql_url
        self.pg_engine = sa.create_engine(pg_url, pool_size=10)
        #: Every tenant's outbox by label (its schema or database name).
        self.outboxes: dict[str, Outbox] = {}
        self._maria: list[str] = []
        for i in range(pg):
            self.add_pg(f"{self.prefix}_t{i:02d}")
        for i in range(maria):
            assert mysql_url is not None
            self.add_maria(f"{self.prefix}_tm{i + 1}")

    @property
    def urls(self) -> list[str]:
        """The ``--db`` URLs: the PostgreSQL database, and MariaDB's server (its ``test``)."""
        return [self.pg_url] + ([self.mysql_url] if self._maria and self.mysql_url else [])

    def add_pg(self, schema: str, engine: sa.Engine | None = None) -> Outbox:
        """Create ``schema`` and install an outbox in it."""
        engine = engine or self.pg_engine
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        outbox = Outbox(engine, schema=schema)
        outbox.install()
        self.outboxes[schema] = outbox
        return outbox

    def add_maria(self, database: str) -> Outbox:
        """Create the MariaDB ``database`` and install an outbox in it."""
        assert self.mysql_url is not None
        server = sa.create_engine(self.mysql_url, poolclass=sa.pool.NullPool)
        with server.begin() as conn:
            conn.execute(sa.text(f"CREATE DATABASE IF NOT EXISTS `{database}`"))
        server.dispose()
        outbox = Outbox(sa.make_url(self.mysql_url).set(database=database))
        outbox.install()
        self.outboxes[database] = outbox
        self._maria.append(database)
        return outbox

    def drop_pg(self, schema: str) -> None:
        """``DROP SCHEMA ... CASCADE`` (the outbox is forgotten)."""
        self.outboxes.pop(schema, None)
        with self.pg_engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))

    def remove(self) -> None:
        """Drop every tenant of the shared servers."""
        with self.pg_engine.begin() as conn:
            names = conn.execute(
                sa.text("SELECT nspname FROM pg_namespace WHERE nspname LIKE :p"),
                {"p": f"{self.prefix}%"},
            ).scalars()
            for name in list(names):
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        for database in self._maria:
            outbox = self.outboxes.get(database)
            if outbox is not None:
                outbox.dispose()
            server = sa.create_engine(self.mysql_url or "", poolclass=sa.pool.NullPool)
            with server.begin() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{database}`"))
            server.dispose()
        self.pg_engine.dispose()

    def unsent(self, labels: Iterable[str] | None = None) -> int:
        """Events not yet sent, over ``labels`` (default: every tenant)."""
        total = 0
        for label in labels if labels is not None else list(self.outboxes):
            t = self.outboxes[label].table
            with self.outboxes[label].engine.connect() as conn:
                total += int(
                    conn.execute(
                        sa.select(sa.func.count()).where(t.c.state != int(State.SENT))
                    ).scalar_one()
                )
        return total


def fleet_args(
    tenants: Tenants, rabbit: RabbitState, *extra: str, dbs: Sequence[str] = ()
) -> list[str]:
    """``outbox relay`` over every tenant (and ``dbs``' schemas matching the pattern)."""
    args = [sys.executable, "-m", "outbox_core.cli", "relay"]
    for url in [*tenants.urls, *dbs]:
        args += ["--db", url]
    return [
        *args, "--schemas", tenants.pattern, "--broker", rabbit.url,
        "--broker-option", f"exchange={rabbit.exchange}", "--broker-option", "reconnect_max=1",
        *extra,
    ]  # fmt: skip


class Arrivals(list[tuple[Any, ...]]):
    """A :class:`Consumer`'s log whose entries carry their arrival time (``time.monotonic()``):
    ``(event id, key, seq, arrived)``."""

    def append(self, item: tuple[Any, ...]) -> None:
        super().append((*item, time.monotonic()))


def consumer(rabbit: RabbitState, queue: str | None = None) -> tuple[Consumer, threading.Thread]:
    """A started consumer of ``queue`` (the test's queue) whose log is :class:`Arrivals`."""
    reader = Consumer(rabbit.url, queue or rabbit.queue, log=Arrivals())  # type: ignore[arg-type]
    thread = threading.Thread(target=reader.run, daemon=True)
    thread.start()
    return reader, thread


@dataclass
class Producer:
    """Commits events into ``outboxes`` until stopped; every ``rollback_every``-th
    transaction is rolled back instead.

    Seqs are never reused (a commit whose answer was lost may have committed),
    so order is checked as "increasing within a key".
    """

    outboxes: dict[str, Outbox]
    keys: int = 5
    per_tx: int = 5
    rollback_every: int = 7
    pause: float = 0.005
    #: event id -> (key, seq, commit time), for commits the database confirmed.
    committed: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    rolled_back: set[str] = field(default_factory=set)
    failures: int = 0
    #: Outboxes not written to now (their database is down, say).
    paused: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    rng: random.Random = field(default_factory=lambda: random.Random(39))
    _seq: int = 0

    def once(self, label: str) -> None:
        """One transaction on ``label``'s outbox (committed or rolled back)."""
        outbox = self.outboxes[label]
        batch: list[tuple[str, str, int]] = []
        self._seq += 1
        rollback = self._seq % self.rollback_every == 0
        try:
            with outbox.engine.connect() as conn, conn.begin() as tx:
                for _ in range(self.per_tx):
                    key = f"{label}/k{self.rng.randrange(self.keys)}"
                    self._seq += 1
                    event_id = outbox.enqueue(conn, TOPIC, {"seq": self._seq}, key=key)
                    batch.append((event_id, key, self._seq))
                if rollback:
                    tx.rollback()
        except Exception:
            self.failures += 1
            self.stop.wait(0.05)
            return
        if rollback:
            self.rolled_back |= {e for e, _, _ in batch}
            return
        now = time.monotonic()
        for event_id, key, seq in batch:
            self.committed[event_id] = (key, seq, now)

    def run(self) -> None:
        """Commit until :attr:`stop` is set."""
        while not self.stop.is_set():
            labels = [label for label in self.outboxes if label not in self.paused]
            if labels:
                self.once(self.rng.choice(labels))
            self.stop.wait(self.pause)

    def start(self) -> threading.Thread:
        """Run on a daemon thread."""
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread


def commit_one(outbox: Outbox, label: str, payload_seq: int = 0) -> tuple[str, float]:
    """Commit one event in ``label``'s outbox: its id and commit time (monotonic)."""
    with outbox.engine.begin() as conn:
        event_id = outbox.enqueue(conn, TOPIC, {"seq": payload_seq}, key=f"{label}/fresh")
    return event_id, time.monotonic()


@dataclass
class Check:
    """The verdict on what arrived: first deliveries, duplicates, lost, order, leaks."""

    first: dict[str, float]
    duplicates: int
    lost: set[str]
    violations: list[tuple[str, int, int]]
    leaked: set[str]


def check(received: Sequence[tuple[Any, ...]], producer: Producer) -> Check:
    """Judge ``received`` (:class:`Arrivals` entries) against what ``producer`` committed."""
    first: dict[str, float] = {}
    last: dict[str, int] = {}
    violations = []
    duplicates = 0
    for event_id, key, seq, at in received:
        if event_id in first:
            duplicates += 1
            continue
        first[event_id] = at
        if seq <= last.get(key, -1):
            violations.append((key, last[key], seq))
        last[key] = seq
    return Check(
        first=first,
        duplicates=duplicates,
        lost=producer.committed.keys() - first.keys(),
        violations=violations,
        leaked=producer.rolled_back & first.keys(),
    )
