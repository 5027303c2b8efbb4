"""The log-tailing relay: outbox inserts read from PostgreSQL's logical slot, in commit order.

One thread does it all (docs/architecture.md, Log tailing)::

    txn = stream.read()              # whole committed transactions, commit order
    events -> per-key lanes          # in memory; a key's events wait behind its head
    outcomes = delivery.deliver(...) # the polling relay's Delivery and Breaker
    stream.confirm(end_lsn)          # only past transactions whose events are all done

Nothing is written per event: a row is touched only when its event becomes
dead (one upsert by ``event_id``). ``outbox replay`` sets dead rows pending;
the publication sends that update and the relay takes the rows back in.
Soon after each confirm (at most every 0.1 s) and at least once a second the
relay reports its progress in ``<table>_wal``: its confirmed position, the
oldest event it holds, for ``outbox status``. A slot's confirmed position
survives a server crash only as of the server's last save of it; the
progress row survives it, so a (re)connecting relay starts at whichever is
later (:meth:`WalRelay.choose_start`).

An event that must wait longer than ``defer_after`` (a long delay or
backoff) is handed to the table instead (``lease_owner`` ``wal:deferred``,
one upsert), with its key's events in memory and the key's later ones
behind it: the slot moves on meanwhile. The relay publishes deferred rows
from the table when due, each key's in hand-over (commit) order, and the key
returns to the stream once none is left.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect, delete_in_batches
from outbox_core.dialects.postgresql.wal import (
    SlotInUse,
    StreamStart,
    WalConnectionError,
    WalStream,
    WalTransaction,
    format_lsn,
    validate_slot_name,
)
from outbox_core.dialects.postgresql.wal.table import WalTable
from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult, Event, Outcome
from outbox_core.relay import settle
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.lifecycle import Closing
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.schedule import Every
from outbox_core.relay.signals import stop_on_signals
from outbox_core.relay.state import BrokerState, DatabaseState
from outbox_core.retry import Backoff, RetryPolicy

log = logging.getLogger("outbox.relay")

#: A standby retries a slot in use at most this far apart: it takes over within ~1 s.
STANDBY_MAX = 1.0
#: Longest wait between reconnections after the database went away.
RECONNECT_MAX = 5.0
#: Longest read wait when nothing is due (stop and retries are noticed this fast).
READ_WAIT = 0.5
#: An idle slot is confirmed to the server's WAL end at most this often.
IDLE_CONFIRM = 1.0
#: The publication of ``outbox install --source wal``: inserts, and updates for replays.
PUBLISH = ("insert", "update")
#: The relay's progress row in ``<table>_wal`` is written at least this often (what it
#: holds and how old, for status) ...
REPORT_EVERY = 1.0
#: ... and once a confirm moved, at most this often: a crash then resends at most about
#: this much besides what was in flight (a write per confirm would slow a drain).
PROGRESS_EVERY = 0.1
#: Published counts are sampled this often for the last minute's figure.
RATE_SAMPLE = 1.0
RATE_WINDOW = 60.0
#: Deferred rows are looked for at most this often (and at once after a full batch) ...
DEFERRED_EVERY = 0.5
#: ... and at least this often while some wait.
DEFERRED_IDLE = 30.0


def wal_names(settings: Settings) -> tuple[str, str]:
    """The slot and publication: the settings' or ``outbox_<table>`` (lower-case)."""
    default = f"outbox_{settings.table.lower()}"[:63]
    return validate_slot_name(settings.slot or default), settings.publication or default


@dataclass(eq=False)
class _Txn:
    """A transaction read from the slot: confirmable once ``open`` reaches 0."""

    end_lsn: int
    open: int = 0


@dataclass(eq=False)
class _Item:
    """One event in memory: its place in the stream, its transaction, its retries."""

    seq: int
    event: Event
    txn: _Txn
    lane: str
    not_before: float = 0.0
    attempts: int = 0


@dataclass(frozen=True)
class _Resume:
    """Where a stream started, and why there."""

    lsn: int
    why: str


class WalRelay(Closing):
    """Publishes the outbox table's inserts read from a logical replication slot.

    Same brokers, outcomes, :class:`Delivery` and :class:`Breaker` as the
    polling :class:`~outbox_core.relay.Relay`; always ordered per key, in
    commit order. ``open_stream(choose_start=...)`` makes a :class:`WalStream`
    (a new one after each lost connection), passing ``choose_start`` on: the
    stream starts where :meth:`choose_start` says. ``run()`` blocks until
    :meth:`stop` or SIGTERM/SIGINT.
    """

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        broker: Broker,
        settings: Settings,
        open_stream: Callable[..., WalStream],
        *,
        name: str = "wal",
        retry_policy: RetryPolicy | None = None,
        max_backlog: int | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.broker = broker
        self.settings = settings
        self.open_stream = open_stream
        self.name = name
        self.retry = retry_policy or RetryPolicy(
            max_attempts=settings.max_attempts,
            base=settings.backoff_base,
            cap=settings.backoff_cap,
        )
        self.batch_size = settings.batch_size
        #: Events held in memory before reading pauses (the stream is kept alive meanwhile).
        self.max_backlog = max_backlog or max(10 * self.batch_size, 1000)
        self.observers: list[RelayObserver] = []
        self.breaker = Breaker(broker, self.observers)
        # runs=True: a key's later events in a batch go only once its earlier one is accepted.
        self.delivery = Delivery(broker, self.breaker, ordered=True, runs=True)
        self.stream: WalStream | None = None
        self._stop = threading.Event()
        self._seq = itertools.count()
        self._txns: deque[_Txn] = deque()
        self._lanes: dict[str, deque[_Item]] = {}
        self._held = 0
        #: Keys with a dead event (block_on_dead): their later events are held dead too.
        self.dead_keys: set[str] = set()
        #: Keys with events handed to the table: their later events go there too.
        self.deferred_keys: set[str] = set()
        #: Monotonic time deferred rows are next looked for (the earliest due one).
        self._deferred_at = 0.0
        self._deferred_full = False
        #: Rows may wait in the table (set by a hand-over, found at connect).
        self._maybe_deferred = False
        self._handed_at = datetime.min.replace(tzinfo=UTC)
        #: Events handed to the table and published from it (counted in ``published``).
        self.deferred = 0
        self._idle_confirmed_at = 0.0
        self._cleanup = Every(settings.cleanup_interval if settings.cleanup_after > 0 else 0)
        #: Monotonic time of the last progress report, and whether a confirm came since.
        self._reported_at = 0.0
        self._unreported = False
        self._reporting = True
        self._report_failing = False
        #: The table's statements for log tailing (refuses a database but PostgreSQL).
        self.table = WalTable(dialect)
        #: Partitioned ordering does not apply (``/metrics`` asks).
        self.membership = None
        self._database = DatabaseState()
        self._last_cycle_at = 0.0
        #: ``created_at`` of the last event read by a step that stopped at its batch or
        #: the backlog (more is waiting in the slot: that old at least); None: caught up.
        self._behind_at: datetime | None = None
        #: The oldest event read and not published, or waiting unread (as of the last step).
        self.oldest_unpublished: datetime | None = None
        #: Counters for tests and logs: published (broker-confirmed), dead, duplicates unknown.
        self.published = 0
        self.dead = 0
        #: (monotonic time, published) samples over the last minute, oldest first.
        self._published_at: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        #: Where this relay's last stream was confirmed to, and on which WAL history
        #: (system id, timeline): a reconnect to the same history may start there.
        self._settled: tuple[str, int, int] | None = None
        #: Where the current stream started and why (logged once it is open).
        self._resume: _Resume | None = None
        #: Monotonic time the connection was lost (None: not lost since the last connect).
        self._lost_at: float | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Events read and not done yet (published nor dead)."""
        return self._held

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up? (``/healthz``)"""
        return self.breaker.state

    @property
    def database_state(self) -> DatabaseState:
        """Could the database, or its replication connection, be reached last time?"""
        return self._database

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished step or broker probe (health checks)."""
        return max(self._last_cycle_at, self.breaker.probed_at)

    def oldest_held(self) -> datetime | None:
        """``created_at`` of the oldest event read and not published (None: none held).

        Relay thread only: ``oldest_unpublished`` is the value other threads read.
        """
        # Every item, not the lane heads: a long transaction committed behind a newer
        # event of its key, or a replayed event, is older than its lane's head.
        return min(
            (item.event.created_at for items in self._lanes.values() for item in items),
            default=None,
        )

    def _note_oldest(self) -> None:
        """Set ``oldest_unpublished`` (on the relay thread; ``/metrics`` reads it)."""
        oldest = self.oldest_held()
        behind = self._behind_at
        if behind is not None and (oldest is None or behind < oldest):
            oldest = behind
        self.oldest_unpublished = oldest

    def _database_is(self, up: bool, error: str | None = None) -> None:
        if self._database.up == up:
            return
        self._database = DatabaseState(up=up, error=error)
        for observer in self.observers:
            observer.database_changed(self._database)

    # -- reading ------------------------------------------------------------------------

    def _replayed(self, ids: Sequence[int]) -> list[tuple[Event, datetime]]:
        """Rows ``outbox replay`` set pending, read back from the table."""
        with self.engine.connect() as conn:
            return self.table.replayed(conn, ids, self.name)

    def _intake(self, txn: WalTransaction) -> None:
        """Put a transaction's events in their lanes (or hand them to the table); kill
        those of dead keys."""
        # Rows a relay handed to the table (and its updates of them) are not new events.
        pending = [r for r in txn.rows if self.table.is_pending(r) and not self.table.is_ours(r)]
        # Our own dead-marking (state DEAD) is in the log too: only a return to pending counts.
        replays = [int(str(r.values["id"])) for r in pending if r.op == "update"]
        events = [self.table.event(r, self.name) for r in pending if r.op == "insert"]
        if replays:
            events += self._replayed(replays)
            if self.settings.block_on_dead:
                # Replaying one dead event of a key while others of it stay
                # dead does not free the key: the table says which keys stay held.
                self._load_dead_keys()
        record = _Txn(txn.end_lsn)
        self._txns.append(record)
        now, wall = time.monotonic(), datetime.now(UTC)
        handed: list[tuple[Event, int, datetime, str | None]] = []
        for event, available_at in events:
            lane = event.key if event.key is not None else f"\0{event.event_id}"
            # enqueue(delay=): the event waits (TIMESTAMPTZ: aware from the log and the table).
            wait = max(0.0, (available_at - wall).total_seconds())
            held_dead = self.settings.block_on_dead and event.key in self.dead_keys
            if not held_dead and (lane in self.deferred_keys or wait > self.settings.defer_after):
                # Behind its key's events in memory, which go to the table first.
                handed += self._take_lane(lane)
                handed.append((event, 0, available_at, None))
                if event.key is not None:
                    self.deferred_keys.add(event.key)
                continue
            item = _Item(next(self._seq), event, record, lane, not_before=now + wait)
            self._lanes.setdefault(lane, deque()).append(item)
            record.open += 1
            self._held += 1
        if handed:
            self._hand_over(handed)
        if self.dead_keys:
            blocked = [key for key in self.dead_keys if key in self._lanes]
            if blocked:
                self._kill([], blocked=blocked)

    # -- publishing ---------------------------------------------------------------------

    def _due(self, now: float) -> list[_Item]:
        """The next batch: each lane's due run from its head, in stream order."""
        runs: list[_Item] = []
        for items in self._lanes.values():
            for taken, item in enumerate(items):
                if item.not_before > now or taken >= self.batch_size:
                    break
                runs.append(item)
        runs.sort(key=lambda i: i.seq)
        return runs[: self.batch_size]

    def _next_due(self) -> float | None:
        """Monotonic time the earliest lane head becomes due (None: nothing held)."""
        return min((items[0].not_before for items in self._lanes.values()), default=None)

    def _publish(self, batch: Sequence[_Item]) -> None:
        """Publish one batch and settle it in memory (dead ones in the table)."""
        events = [i.event for i in batch]
        outcomes = self.delivery.deliver(events)
        self.breaker.note(outcomes)
        started = now = time.monotonic()
        plan = settle.sort_outcomes(
            "", events, outcomes, self.retry, attempts=[i.attempts + 1 for i in batch]
        )
        # By the event object: a replayed row may come round again with its id.
        items = {id(i.event): i for i in batch}
        for item, outcome in zip(batch, outcomes, strict=True):
            if outcome is not None and outcome.is_ok:
                self._done(item)
        self.published += len(plan.sent)
        dead: list[tuple[_Item, str]] = []
        handed: list[tuple[Event, int, datetime, str | None]] = []
        for event, failure in zip(plan.failed, plan.failures, strict=True):
            item = items[id(event)]
            item.attempts += 1
            delay, error = failure.retry_in, failure.error
            if delay is None:
                dead.append((item, error))
                continue
            item.not_before = now + delay
            deferring = delay > self.settings.defer_after
            if deferring:
                # A long backoff would hold the slot: the key's lane waits in the table.
                lane = self._take_lane(item.lane)
                handed += [(e, n, due, error if e is item.event else None) for e, n, due, _ in lane]
                if event.key is not None:
                    self.deferred_keys.add(event.key)
            log.warning(
                "event %s (%s) retries in %.1fs%s: %s",
                event.event_id,
                event.topic,
                delay,
                ", from the table" if deferring else "",
                error,
                extra={"event_id": event.event_id, "topic": event.topic},
            )
        if dead:
            self._kill(dead)
        if handed:
            self._hand_over(handed)
        self._observe(events, outcomes, plan, len(batch), started)

    def _observe(
        self,
        events: Sequence[Event],
        outcomes: Sequence[Outcome | None],
        plan: settle.SettlePlan,
        claimed: int,
        started: float,
    ) -> None:
        """Tell the observers (metrics) of a published batch, as the polling relay does."""
        seconds = time.monotonic() - started
        answered, answers = settle.published(events, outcomes)
        dead = sum(1 for f in plan.failures if f.retry_in is None)
        for observer in self.observers:
            if answered:
                observer.settled(
                    answered,
                    answers,
                    plan.failures,
                    sent=len(plan.sent),
                    lost=0,
                    seconds=seconds,
                )
            observer.cycle(
                CycleResult(
                    claimed=claimed,
                    sent=len(plan.sent),
                    retried=len(plan.failures) - dead,
                    dead=dead,
                    unavailable=plan.unavailable,
                )
            )

    # -- deferring: long waits go to the table -------------------------------------------

    def _take_lane(self, lane: str) -> list[tuple[Event, int, datetime, str | None]]:
        """Remove a lane's events from memory (done for their transactions); to hand over."""
        items = self._lanes.pop(lane, None)
        if not items:
            return []
        now, wall = time.monotonic(), datetime.now(UTC)
        taken: list[tuple[Event, int, datetime, str | None]] = []
        for item in items:
            due = wall + timedelta(seconds=max(0.0, item.not_before - now))
            taken.append((item.event, item.attempts, due, None))
            item.txn.open -= 1
            self._held -= 1
        return taken

    def _hand_over(self, rows: Sequence[tuple[Event, int, datetime, str | None]]) -> None:
        """Write events to the table as deferred, in this order (one transaction)."""
        # lease_until records the hand-over order across calls (ids may not be in it).
        start = max(datetime.now(UTC), self._handed_at + timedelta(microseconds=1))
        ordered = [
            (event, attempts, due, start + timedelta(microseconds=i), error)
            for i, (event, attempts, due, error) in enumerate(rows)
        ]
        self._handed_at = ordered[-1][3]
        with self.engine.connect() as conn:
            self.table.defer(conn, ordered)
        self._maybe_deferred = True
        wall = datetime.now(UTC)
        first_due = min((due - wall).total_seconds() for _, _, due, _ in rows)
        self._deferred_at = min(self._deferred_at, time.monotonic() + max(0.0, first_due))
        log.info(
            "%d event(s) handed to the table to wait (first %s, key %r)",
            len(rows),
            rows[0][0].event_id,
            rows[0][0].key,
            extra={"count": len(rows)},
        )

    def _publish_deferred(self) -> None:
        """Publish due deferred rows from the table and settle them there."""
        block = self.settings.block_on_dead
        with self.engine.connect() as conn:
            runs = self.table.deferred_runs(conn, self.batch_size, self.name, block_on_dead=block)
            if not runs:
                self._schedule_deferred(conn)
        self._deferred_full = len(runs) >= self.batch_size
        if not runs:
            return
        events = [e for e, _ in runs]
        outcomes = self.delivery.deliver(events)
        self.breaker.note(outcomes)
        tries = [spent + 1 for _, spent in runs]
        plan = settle.sort_outcomes("", events, outcomes, self.retry, attempts=tries)
        sent = plan.sent
        spent_by = {id(e): n for e, n in zip(events, tries, strict=True)}
        retries: list[tuple[int, int, float, str]] = []
        dead: list[tuple[Event, int, str]] = []
        for event, failure in zip(plan.failed, plan.failures, strict=True):
            if failure.retry_in is None:
                dead.append((event, spent_by[id(event)], failure.error))
            else:
                retries.append((event.id, spent_by[id(event)], failure.retry_in, failure.error))
        started = time.monotonic()
        keys = {e.key for e in events if e.key is not None}
        dead_keys = {e.key for e, _, _ in dead if e.key is not None} if block else set()
        with self.engine.connect() as conn:
            # One transaction: a dead row never stands without its key's later rows dead.
            with self.dialect.transaction(conn):
                self.table.settle_deferred(
                    conn, sent=sent, retries=retries, delete=self.settings.delete_on_send
                )
                if dead:
                    self.table.mark_dead(conn, dead)
                if dead_keys:
                    # The key's later deferred events are held dead behind it.
                    self.table.kill_deferred(conn, dead_keys)
            self.dead_keys |= dead_keys
            # Only the keys of this batch can have left the table.
            still = self.table.deferred_keys(conn, among=keys) if keys else set()
            self.deferred_keys = (self.deferred_keys - keys) | still
            if retries:
                soonest = min(delay for _, _, delay, _ in retries)
                self._deferred_at = min(self._deferred_at, time.monotonic() + soonest)
        self.published += len(sent)
        self.deferred += len(sent)
        self.dead += len(dead)
        for event, _, error in dead:
            log.error(
                "event %s (%s) is dead: %s",
                event.event_id,
                event.topic,
                error,
                extra={"event_id": event.event_id, "topic": event.topic},
            )
        self._observe(events, outcomes, plan, len(runs), started)

    def _schedule_deferred(self, conn: sa.Connection) -> None:
        """Nothing due in the table: look again when its earliest key head is due."""
        due = self.table.next_deferred_due(conn)
        self._maybe_deferred = due is not None
        if due is None:
            self.deferred_keys = set()  # none left (whatever removed them)
            return
        wait = (due - datetime.now(UTC)).total_seconds()
        # At least DEFERRED_EVERY apart; at most DEFERRED_IDLE (rows replayed meanwhile).
        self._deferred_at = time.monotonic() + min(max(wait, DEFERRED_EVERY), DEFERRED_IDLE)

    def _done(self, item: _Item) -> None:
        lane = self._lanes[item.lane]
        # Outcomes come in stream order and a key's later event goes only after its
        # earlier one was accepted: what is done is always its lane's head.
        assert lane[0] is item
        lane.popleft()
        if not lane:
            del self._lanes[item.lane]
        item.txn.open -= 1
        self._held -= 1

    def _kill(self, dead: Sequence[tuple[_Item, str]], *, blocked: Iterable[str] = ()) -> None:
        """Mark events dead in the table (one upsert each, one transaction), then forget them.

        With ``block_on_dead`` a dead event's key is held: its events in memory,
        and those read later, are made dead behind it (``outbox replay --key``
        brings them back together, in id order).
        """
        doomed = list(dead)
        keys = set(blocked)
        if self.settings.block_on_dead:
            keys |= {i.event.key for i, _ in dead if i.event.key is not None}
        named = {id(i) for i, _ in doomed}
        for key in keys:
            for item in self._lanes.get(key, ()):
                if id(item) not in named:
                    doomed.append((item, f"held: an earlier event of key {key!r} is dead"))
        with self.engine.connect() as conn:
            self.table.mark_dead(conn, [(i.event, i.attempts, error) for i, error in doomed])
        self.dead_keys |= keys
        for item, error in doomed:
            lane = self._lanes.get(item.lane)
            if lane is not None:
                lane.remove(item)
                if not lane:
                    del self._lanes[item.lane]
            item.txn.open -= 1
            self._held -= 1
            self.dead += 1
            log.error(
                "event %s (%s) is dead: %s",
                item.event.event_id,
                item.event.topic,
                error,
                extra={"event_id": item.event.event_id, "topic": item.event.topic},
            )

    # -- confirming ---------------------------------------------------------------------

    def _confirm(self, stream: WalStream) -> bool:
        """Confirm past every transaction whose events, and every earlier one's, are done;
        True when the confirmed position moved."""
        lsn = None
        while self._txns and self._txns[0].open == 0:
            lsn = self._txns.popleft().end_lsn
        if lsn is not None:
            moved = lsn > stream.confirmed_lsn
            stream.confirm(lsn)
            log.debug("confirmed %s", format_lsn(lsn))
            return moved
        if not self._txns and time.monotonic() - self._idle_confirmed_at > IDLE_CONFIRM:
            # Nothing in flight: let the slot drop WAL of changes nobody watches.
            self._idle_confirmed_at = time.monotonic()
            idle = stream.idle_lsn
            if idle is not None:
                stream.confirm(idle)
                return True
        return False

    def choose_start(self, start: StreamStart) -> int:
        """Where a new stream starts: the latest position known settled on this server.

        The slot's confirmed position is saved by the server only now and
        then (a checkpoint), so after a crash it may be older than what
        was confirmed; the progress row in ``<table>_wal`` (committed after
        the confirm it reports) and this relay's own last confirm are not.
        The row counts only if it lies within the server's WAL (a row restored
        from another cluster's backup would skip what is written later); this
        relay's own position only on the same WAL history (not on a promoted
        standby, whose WAL after the promotion differs). Every candidate
        means: each transaction committed before it is published, dead or
        handed to the table.
        """
        slot = start.slot
        candidates = [_Resume(start.slot_lsn, "the slot's confirmed position")]
        with self.engine.connect() as conn:
            row = self.table.settled_lsn(conn, slot)
        if row is not None and row > start.flush_lsn:
            log.warning(
                "the progress row of slot %r (%s) lies beyond the server's WAL (%s): "
                "ignored (restored from another server?)",
                slot,
                format_lsn(row),
                format_lsn(start.flush_lsn),
            )
        elif row is not None:
            candidates.append(_Resume(row, "the progress row"))
        settled = self._settled
        if (
            settled is not None
            and settled[:2] == (start.system_id, start.timeline)
            and settled[2] <= start.flush_lsn
        ):
            candidates.append(_Resume(settled[2], "this relay's last confirm"))
        best = max(candidates, key=lambda c: c.lsn)
        if best.lsn > start.slot_lsn:
            ahead = _bytes(best.lsn - start.slot_lsn)
            why = f"{best.why}, {ahead} past the slot's {format_lsn(start.slot_lsn)}"
            best = _Resume(best.lsn, why)
        self._resume = best
        return best.lsn

    # -- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in flight (thread-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self._stop.is_set()

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally (exit code 0)."""
        try:
            with stop_on_signals(self.stop, install=install_signal_handlers):
                log.info("wal relay %s started (batch %d)", self.name, self.batch_size)
                self.breaker.probe_at_start()
                self._loop()
                if self.stream is not None:
                    # The last word for status: what it held is sent again by the next relay.
                    self._note_oldest()
                    self.report(self.stream, durable=True)
        finally:
            self.close()
            log.info(
                "wal relay %s stopped (%d published, %d dead)",
                self.name,
                self.published,
                self.dead,
            )

    def _loop(self) -> None:
        lost = Backoff(0.2, RECONNECT_MAX, jitter=0.2)
        while not self.stopping:
            try:
                if self.stream is None:
                    self.stream = self._connect()
                    if self.stream is None:
                        return
                    lost.reset()
                self.step(self.stream)
                self._database_is(True)
            except (WalConnectionError, DatabaseError, sa.exc.OperationalError) as exc:
                # The database restarted or the connection broke: what was not confirmed
                # comes again from the settled position (at least once).
                if self._lost_at is None:
                    self._lost_at = time.monotonic()
                    log.warning("connection lost (%s): reconnecting to the slot", _short(exc))
                else:
                    log.debug("reconnecting failed (%s): retrying", _short(exc))
                self._database_is(False, _short(exc))
                self._forget()
                self._stop.wait(lost.next())

    def _connect(self) -> WalStream | None:
        """A new stream; waits as a standby while another relay reads the slot."""
        standby = Backoff(0.1, STANDBY_MAX, jitter=0.2)
        waiting = False
        while not self.stopping:
            try:
                stream = self.open_stream(choose_start=self.choose_start)
            except SlotInUse:
                if not waiting:
                    log.info("slot in use by another relay: standing by to take over")
                    waiting = True
                self._last_cycle_at = time.time()  # a standby is healthy (/healthz)
                self._stop.wait(standby.next())
                continue
            try:
                if self.settings.block_on_dead:
                    # At every (re)connect: while this relay stood by, another
                    # may have relayed a replay of a key held here.
                    self._load_dead_keys()
                with self.engine.connect() as conn:
                    self.deferred_keys = self.table.deferred_keys(conn)
                    # Hand-overs follow the previous relay's (its clock may be ahead).
                    last = self.table.last_handed(conn)
                    if last is not None and last > self._handed_at:
                        self._handed_at = last
                    self._maybe_deferred = True
                    self._deferred_at = 0.0
                self._started(stream, took_over=waiting)
            except BaseException:
                stream.close()
                raise
            return stream
        return None

    def _started(self, stream: WalStream, *, took_over: bool) -> None:
        """Move the slot to where the stream started; one line on where that is."""
        if stream.start_lsn > stream.confirmed_lsn:
            # The slot may be behind (a crash lost its confirmations): catch it up.
            stream.confirm(stream.start_lsn)
        resume = self._resume or _Resume(stream.start_lsn, "the slot's confirmed position")
        where = f"{format_lsn(stream.start_lsn)} ({resume.why})"
        slot = stream.slot
        if self._lost_at is not None:
            away = time.monotonic() - self._lost_at
            log.info("reconnected to slot %r after %.1fs: resuming from %s", slot, away, where)
        elif took_over:
            log.info("took over slot %r from another relay: resuming from %s", slot, where)
        else:
            log.info("reading slot %r from %s", slot, where)
        self._lost_at = None
        self._resume = None

    def _load_dead_keys(self) -> None:
        """Keys with dead rows in the table hold their later events (as the polling relay)."""
        with self.engine.connect() as conn:
            self.dead_keys = self.table.dead_keys(conn)

    def step(self, stream: WalStream) -> None:
        """Read what arrived, publish one batch, confirm; keep the stream alive while down."""
        if not self.breaker.ready():
            # Broker down: publish nothing, spend nothing; read on while memory allows
            # (what waits is then held, and reported), then only answer keepalives.
            wait = min(0.2, max(0.01, self.breaker.until_probe()))
            if self._read(stream, wait) == 0 and self._held >= self.max_backlog:
                stream.keep_alive()
                self._stop.wait(wait)
            self._finish_step(stream)
            return
        now = time.monotonic()
        due = self._next_due()
        wait = READ_WAIT if due is None else min(READ_WAIT, max(0.0, due - now))
        self._read(stream, wait)
        if self._maybe_deferred and (self._deferred_full or time.monotonic() >= self._deferred_at):
            self._publish_deferred()
        batch = self._due(time.monotonic())
        if batch and self.breaker.state.up:  # (publishing deferred rows may have found it down)
            self._publish(batch)
        elif self._held >= self.max_backlog:
            # Full, and every lane waits for a retry: answer the server, then wait for it.
            stream.keep_alive()
            self._stop.wait(wait)
        self._finish_step(stream)

    def _read(self, stream: WalStream, wait: float) -> int:
        """Take in transactions until a batch's worth, the backlog or the wait is reached."""
        taken = 0
        last: datetime | None = None
        while self._held < self.max_backlog and taken < self.batch_size:
            txn = stream.read(wait)
            if txn is None:
                self._behind_at = None  # the slot had nothing more
                return taken
            before = self._held
            self._intake(txn)
            last = txn.commit_time
            # Events against the batch; an eventless transaction counts one (the loop ends).
            taken += max(1, self._held - before)
            wait = 0.0
        # Stopped at a limit: what waits unread committed after the last transaction read.
        self._behind_at = last
        return taken

    def _finish_step(self, stream: WalStream) -> None:
        self._unreported |= self._confirm(stream)
        self._note_oldest()
        now = time.monotonic()
        since = now - self._reported_at
        # Soon after a confirm: the next reader of the slot starts there, even after a crash.
        if since >= REPORT_EVERY or (self._unreported and since >= PROGRESS_EVERY):
            self.report(stream)
        if self._cleanup.due(now):
            self.cleanup()
        self._last_cycle_at = time.time()

    def report(self, stream: WalStream, *, durable: bool = False) -> None:
        """Write this relay's progress in ``<table>_wal``: where the next reader of the slot
        may start, and what ``outbox status`` shows (``durable``: wait for the disk)."""
        self._reported_at = time.monotonic()
        self._unreported = False
        if not self._reporting:
            return
        try:
            with self.engine.connect() as conn:
                self.table.report(
                    conn,
                    slot=stream.slot,
                    relay=self.name,
                    confirmed_lsn=stream.confirmed_lsn,
                    held=self._held,
                    oldest_held_at=self.oldest_unpublished,
                    read_lsn=stream.read_lsn,
                    published_last_minute=self.published_last_minute(),
                    durable=durable,
                )
            self._report_failing = False
        except sa.exc.ProgrammingError as exc:
            # No <table>_wal (installed before it existed) or no right to write it:
            # relaying goes on; status cannot tell the oldest unpublished event's age.
            self._reporting = False
            log.warning(
                "cannot report progress in %s (%s): `outbox install --source wal` creates it; "
                "relaying goes on",
                self.table.progress_table.fullname,
                _short(exc),
            )
        except sa.exc.SQLAlchemyError as exc:
            # A report is not worth the stream: the next one may get through.
            if not self._report_failing:
                log.warning("cannot report progress (%s): retrying", _short(exc))
            self._report_failing = True

    def published_last_minute(self) -> int:
        """Events published in about the last minute (since the start, if sooner)."""
        now = time.monotonic()
        samples = self._published_at
        if now - samples[-1][0] >= RATE_SAMPLE:
            samples.append((now, self.published))
        # The first sample kept is the last one at least a minute old.
        while len(samples) > 1 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        return self.published - samples[0][1]

    def cleanup(self) -> int:
        """Delete rows older than ``cleanup_after`` whatever their state but dead (at most
        10 batches): their events came from the log (:meth:`WalTable.cleanup`)."""
        with self.engine.connect() as conn:
            total = delete_in_batches(
                lambda n: self.table.cleanup(conn, older_than=self.settings.cleanup_after, batch=n),
                batch=self.settings.cleanup_batch,
                max_batches=10,
            )
        if total:
            log.info("cleanup removed %d relayed rows", total, extra={"count": total})
        return total

    def _forget(self) -> None:
        """Drop the stream and everything read from it (it comes again from the slot)."""
        stream = self.stream
        if stream is not None:
            started = stream.started
            if started is not None and stream.confirmed_lsn:
                self._settled = (started.system_id, started.timeline, stream.confirmed_lsn)
            stream.close()
            self.stream = None
        self._txns.clear()
        self._lanes.clear()
        self._held = 0

    def close(self) -> None:
        """Close the stream (nothing unconfirmed is confirmed) and the broker."""
        self._forget()
        self.close_broker()


def _bytes(n: int) -> str:
    """A WAL distance for a log line."""
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"


def _short(exc: BaseException) -> str:
    from outbox_core.redaction import redact

    return redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300]
