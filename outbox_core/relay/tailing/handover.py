"""Long waits handed to the table, so that the log moves on meanwhile.

An event that must wait longer than ``defer_after`` (a long delay or
backoff) is handed to the table (``lease_owner`` ``wal:deferred``, one
upsert), with its key's events in memory and the key's later ones behind
it. The relay publishes deferred rows from the table when due, each key's in
hand-over (commit) order, and the key returns to the stream once none is
left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import Connection, Engine

from outbox_core.config import Settings
from outbox_core.dialects.base.tailing.table import LogTable
from outbox_core.message import Event, Outcome
from outbox_core.relay import settle
from outbox_core.relay.delivery import Delivery
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")

#: Deferred rows are looked for at most this often (and at once after a full batch) ...
DEFERRED_EVERY = 0.5
#: ... and at least this often while some wait.
DEFERRED_IDLE = 30.0

#: An event to hand over: (event, attempts spent, when due, the error of its last try).
Handed = tuple[Event, int, datetime, str | None]


@dataclass
class DeferredBatch:
    """Deferred rows published and settled in the table."""

    events: list[Event]
    outcomes: Sequence[Outcome | None]
    plan: settle.SettlePlan
    #: (event, attempts, error) of those now dead.
    dead: list[tuple[Event, int, str]]
    #: Keys held by a dead event (``block_on_dead``).
    dead_keys: set[str]
    #: Monotonic time the settling began.
    started: float


class HandOver:
    """The keys waiting in the table, handing events over, and publishing them back."""

    def __init__(self, engine: Engine, table: LogTable, settings: Settings, relay: str) -> None:
        self.engine = engine
        self.rows = table.deferred
        self.dialect = table.dialect
        self.table = table
        self.settings = settings
        self.relay = relay
        #: Keys with events handed to the table: their later events go there too.
        self.keys: set[str] = set()
        #: Events handed to the table and published from it.
        self.published = 0
        #: Monotonic time deferred rows are next looked for (the earliest due one).
        self._next_at = 0.0
        self._full = False
        #: Rows may wait in the table (set by a hand-over, found at connect).
        self._maybe = False
        self._handed_at = datetime.min.replace(tzinfo=UTC)

    def resume(self, conn: Connection) -> None:
        """At (re)connect: the keys in the table, and hand-overs after the previous relay's."""
        self.keys = self.rows.keys(conn)
        # Hand-overs follow the previous relay's (its clock may be ahead).
        last = self.rows.last_handed(conn)
        if last is not None and last > self._handed_at:
            self._handed_at = last
        self._maybe = True
        self._next_at = 0.0

    def hand(self, rows: Sequence[Handed]) -> None:
        """Write events to the table as deferred, in this order (one transaction)."""
        # lease_until records the hand-over order across calls (ids may not be in it).
        start = max(datetime.now(UTC), self._handed_at + timedelta(microseconds=1))
        ordered = [
            (event, attempts, due, start + timedelta(microseconds=i), error)
            for i, (event, attempts, due, error) in enumerate(rows)
        ]
        self._handed_at = ordered[-1][3]
        with self.engine.connect() as conn:
            self.rows.defer(conn, ordered)
        self._maybe = True
        wall = datetime.now(UTC)
        first_due = min((due - wall).total_seconds() for _, _, due, _ in rows)
        self._next_at = min(self._next_at, time.monotonic() + max(0.0, first_due))
        log.info(
            "%d event(s) handed to the table to wait (first %s, key %r)",
            len(rows),
            rows[0][0].event_id,
            rows[0][0].key,
            extra={"count": len(rows)},
        )

    def due(self) -> bool:
        """Deferred rows may be due now."""
        return self._maybe and (self._full or time.monotonic() >= self._next_at)

    def publish(self, delivery: Delivery, retry: RetryPolicy, limit: int) -> DeferredBatch | None:
        """Publish due deferred rows from the table and settle them there (None: none due)."""
        block = self.settings.block_on_dead
        with self.engine.connect() as conn:
            runs = self.rows.due_runs(conn, limit, self.relay, block_on_dead=block)
            if not runs:
                self._schedule(conn)
        self._full = len(runs) >= limit
        if not runs:
            return None
        events = [e for e, _ in runs]
        outcomes = delivery.send(events)
        tries = [spent + 1 for _, spent in runs]
        plan = settle.sort_outcomes("", events, outcomes, retry, attempts=tries)
        spent_by = {id(e): n for e, n in zip(events, tries, strict=True)}
        retries: list[tuple[int, int, float, str]] = []
        dead: list[tuple[Event, int, str]] = []
        for event, failure in zip(plan.failed, plan.failures, strict=True):
            if failure.retry_in is None:
                dead.append((event, spent_by[id(event)], failure.error))
            else:
                retries.append((event.id, spent_by[id(event)], failure.retry_in, failure.error))
        started = time.monotonic()
        dead_keys = {e.key for e, _, _ in dead if e.key is not None} if block else set()
        self._settle(events, plan.sent, retries, dead, dead_keys)
        self.published += len(plan.sent)
        return DeferredBatch(events, outcomes, plan, dead, dead_keys, started)

    def _settle(
        self,
        events: Sequence[Event],
        sent: Sequence[int],
        retries: Sequence[tuple[int, int, float, str]],
        dead: Sequence[tuple[Event, int, str]],
        dead_keys: set[str],
    ) -> None:
        keys = {e.key for e in events if e.key is not None}
        with self.engine.connect() as conn:
            # One transaction: a dead row never stands without its key's later rows dead.
            with self.dialect.transaction(conn):
                self.rows.settle(
                    conn, sent=sent, retries=retries, delete=self.settings.delete_on_send
                )
                if dead:
                    self.table.mark_dead(conn, dead)
                if dead_keys:
                    # The key's later deferred events are held dead behind it.
                    self.rows.kill(conn, dead_keys)
            # Only the keys of this batch can have left the table.
            still = self.rows.keys(conn, among=keys) if keys else set()
            self.keys = (self.keys - keys) | still
            if retries:
                soonest = min(delay for _, _, delay, _ in retries)
                self._next_at = min(self._next_at, time.monotonic() + soonest)

    def _schedule(self, conn: Connection) -> None:
        """Nothing due in the table: look again when its earliest key head is due."""
        due = self.rows.next_due(conn)
        self._maybe = due is not None
        if due is None:
            self.keys = set()  # none left (whatever removed them)
            return
        wait = (due - datetime.now(UTC)).total_seconds()
        # At least DEFERRED_EVERY apart; at most DEFERRED_IDLE (rows replayed meanwhile).
        self._next_at = time.monotonic() + min(max(wait, DEFERRED_EVERY), DEFERRED_IDLE)
