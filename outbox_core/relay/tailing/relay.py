"""The log-tailing relay: outbox inserts read from the database's log, in commit order.

One thread does it all (docs/architecture.md, Log tailing)::

    txn = reader.read()              # whole committed transactions, commit order
    events -> per-key lanes          # in memory; a key's events wait behind its head
    outcomes = delivery.send(...)    # the polling relay's Delivery and Breaker
    reader.confirm(watermark)        # only past transactions whose events are all done

Nothing is written per event: a row is touched only when its event becomes
dead (one upsert by ``event_id``). ``outbox replay`` sets dead rows pending;
the log carries that update and the relay takes the rows back in. Its
progress goes to ``<table>_wal`` (:mod:`.reports`), where a (re)connecting
relay starts if that is later than the source's own position
(:mod:`.resume`). A long wait is handed to the table (:mod:`.handover`).
Its row in the presence table is written on a thread of its own, as the
polling relay's (:mod:`outbox_core.relay.presence`).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.base import SessionLimits, delete_in_batches
from outbox_core.errors import DatabaseError
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.connections import Connections
from outbox_core.relay.control import Control
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.lifecycle import ClosableRelay
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.presence import Presence, unique_id
from outbox_core.relay.schedule import Every, Tasks
from outbox_core.relay.signals import stop_on_signals
from outbox_core.relay.state import BrokerState, DatabaseState
from outbox_core.relay.tailing.publisher import Publisher
from outbox_core.relay.tailing.reports import Reports, short
from outbox_core.relay.tailing.resume import Resume
from outbox_core.relay.tailing.source import LogReader, LogSource, LogStart, SourceInUse
from outbox_core.retry import Backoff, RetryPolicy

log = logging.getLogger("outbox.relay")

#: A standby retries a source in use at most this far apart: it takes over within ~1 s.
STANDBY_MAX = 1.0
#: Longest wait between reconnections after the database went away.
RECONNECT_MAX = 5.0
#: Longest read wait when nothing is due (stop and retries are noticed this fast).
READ_WAIT = 0.5
#: An idle source is confirmed to the server's log end at most this often.
IDLE_CONFIRM = 1.0


class TailingRelay(ClosableRelay):
    """Publishes the outbox table's inserts read from a database's log (a :class:`LogSource`).

    Same brokers, outcomes, :class:`Delivery` and :class:`Breaker` as the
    polling :class:`~outbox_core.relay.Relay`; always ordered per key, in
    commit order. Each (re)connect opens a new reader of ``source``, starting
    where :meth:`choose_start` says. ``run()`` blocks until :meth:`stop` or
    SIGTERM/SIGINT.
    """

    def __init__(
        self,
        engine: Engine,
        broker: Broker,
        settings: Settings,
        source: LogSource,
        *,
        name: str = "wal",
        retry_policy: RetryPolicy | None = None,
        max_backlog: int | None = None,
    ) -> None:
        self.engine = engine
        self.broker = broker
        self.settings = settings
        self.source = source
        self.name = name
        self.retry = retry_policy or RetryPolicy(
            max_attempts=settings.max_attempts,
            base=settings.backoff_base,
            cap=settings.backoff_cap,
        )
        self.batch_size = settings.batch_size
        #: Events held in memory before reading pauses (the reader is kept alive meanwhile).
        self.max_backlog = max_backlog or max(10 * self.batch_size, 1000)
        self.observers: list[RelayObserver] = []
        self.breaker = Breaker(broker, self.observers)
        # runs=True: a key's later events in a batch go only once its earlier one is accepted.
        self.delivery = Delivery(broker, self.breaker, ordered=True, runs=True)
        self.control = Control()
        #: The reader of the source (None: not connected).
        self.reader: LogReader | None = None
        #: The events in memory, and publishing them.
        self.publisher = Publisher(
            engine, source.table, settings, self.delivery, self.retry, self.observers, name=name
        )
        self.lanes = self.publisher.lanes
        self.handover = self.publisher.handover
        self.reports = Reports(engine, source, name)
        self.resume = Resume(engine, source)
        dialect = source.table.dialect
        #: This relay's id in the presence table: unique whatever ``name`` says.
        self.relay_id = unique_id(name)
        #: Its row in the presence table (mode ``wal``), on a connection of its own.
        self.presence = Presence(
            self.relay_id,
            "wal",
            dialect.presence,
            Connections(
                engine,
                dialect,
                SessionLimits.for_lease(settings.lease),
                ordered=False,
                stop=self.control.stop_requested,
            ),
            self.control,
            interval=settings.heartbeat,
            dead=lambda: self.dead,
        )
        self.observers.append(self.presence.counts)
        self._idle_confirmed_at = 0.0
        self._cleanup = Every(settings.cleanup_interval if settings.cleanup_after > 0 else 0)
        #: Partitioned ordering does not apply (``/metrics`` asks).
        self.membership = None
        self._database = DatabaseState()
        self._last_cycle_at = 0.0
        #: ``created_at`` of the last event read by a step that stopped at its batch or
        #: the backlog (more is waiting in the log: that old at least); None: caught up.
        self._behind_at: datetime | None = None
        #: The oldest event read and not published, or waiting unread (as of the last step).
        self.oldest_unpublished: datetime | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Events read and not done yet (published nor dead)."""
        return self.lanes.held

    @property
    def published(self) -> int:
        """Events the broker accepted."""
        return self.publisher.published

    @property
    def dead(self) -> int:
        """Events made dead."""
        return self.publisher.dead

    @property
    def dead_keys(self) -> set[str]:
        """Keys with a dead event (``block_on_dead``): their later events are held dead too."""
        return self.publisher.dead_keys

    @property
    def deferred(self) -> int:
        """Events handed to the table and published from it (counted in ``published``)."""
        return self.handover.published

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up? (``/healthz``)"""
        return self.breaker.state

    @property
    def database_state(self) -> DatabaseState:
        """Could the database, or its log's reader, be reached last time?"""
        return self._database

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished step or broker probe (health checks)."""
        return max(self._last_cycle_at, self.breaker.probed_at)

    def oldest_held(self) -> datetime | None:
        """``created_at`` of the oldest event read and not published (None: none held).

        Relay thread only: ``oldest_unpublished`` is the value other threads read.
        """
        return self.lanes.oldest()

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

    # -- confirming ---------------------------------------------------------------------

    def _confirm(self, reader: LogReader) -> bool:
        """Confirm past every transaction whose events, and every earlier one's, are done;
        True when the confirmed position moved."""
        end = self.lanes.watermark()
        if end is not None:
            moved = end > reader.confirmed
            reader.confirm(end)
            log.debug("confirmed %s", self.source.describe(end))
            return moved
        if self.lanes.idle and time.monotonic() - self._idle_confirmed_at > IDLE_CONFIRM:
            # Nothing in flight: let the source drop log nobody watches.
            self._idle_confirmed_at = time.monotonic()
            idle = reader.idle_position
            if idle is not None:
                reader.confirm(idle)
                return True
        return False

    def choose_start(self, start: LogStart) -> int:
        """Where a new reader starts: the latest position known settled on this server
        (:meth:`Resume.choose`)."""
        return self.resume.choose(start)

    # -- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in flight (thread-safe)."""
        self.control.stop()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self.control.stopping

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally (exit code 0)."""
        try:
            with stop_on_signals(self.stop, install=install_signal_handlers):
                log.info(
                    "%s relay %s started (batch %d)", self.source.kind, self.name, self.batch_size
                )
                self.breaker.probe_at_start()
                self._run_loop()
        finally:
            self.close()
            log.info(
                "%s relay %s stopped (%d published, %d dead)",
                self.source.kind,
                self.name,
                self.published,
                self.dead,
            )

    def _run_loop(self) -> None:
        """The loop, the presence row beside it; the last report once stopped."""
        tasks = Tasks([self.presence])
        tasks.start()
        try:
            self._loop()
            if self.reader is not None:
                # The last word for status: what it held is sent again by the next relay.
                self._note_oldest()
                self.report(self.reader, durable=True)
        finally:
            self.control.stop()
            tasks.join()

    def _loop(self) -> None:
        lost = Backoff(0.2, RECONNECT_MAX, jitter=0.2)
        while not self.stopping:
            try:
                if self.reader is None:
                    self.reader = self._connect()
                    if self.reader is None:
                        return
                    lost.reset()
                self.step(self.reader)
                self._database_is(True)
            except (DatabaseError, sa.exc.SQLAlchemyError) as exc:
                # The database restarted or the connection broke: what was not confirmed
                # comes again from the settled position (at least once). Any other
                # database error too, as the polling relay retries every one: a server
                # coming back answers with more than OperationalError.
                if not _connection_error(exc):
                    log.error(
                        "database error (%s: %s): reconnecting to the %s",
                        type(exc).__name__,
                        short(exc),
                        self.source.noun,
                    )
                    self.resume.lost_at = self.resume.lost_at or time.monotonic()
                elif self.resume.lost_at is None:
                    self.resume.lost_at = time.monotonic()
                    log.warning(
                        "connection lost (%s): reconnecting to the %s", short(exc), self.source.noun
                    )
                else:
                    log.debug("reconnecting failed (%s): retrying", short(exc))
                self._database_is(False, short(exc))
                self._forget()
                self.control.sleep(lost.next())

    def _connect(self) -> LogReader | None:
        """A new reader; waits as a standby while another relay reads the source."""
        standby = Backoff(0.1, STANDBY_MAX, jitter=0.2)
        waiting = False
        while not self.stopping:
            try:
                reader = self.source.open(self.choose_start)
            except SourceInUse:
                if not waiting:
                    log.info(
                        "%s in use by another relay: standing by to take over", self.source.noun
                    )
                    waiting = True
                self._last_cycle_at = time.time()  # a standby is healthy (/healthz)
                self.control.sleep(standby.next())
                continue
            try:
                self._connected(reader, took_over=waiting)
            except BaseException:
                reader.close()
                raise
            return reader
        return None

    def _connected(self, reader: LogReader, *, took_over: bool) -> None:
        """A reader is open: what the table holds for this relay, then where it started."""
        if self.settings.block_on_dead:
            # At every (re)connect: while this relay stood by, another
            # may have relayed a replay of a key held here.
            self.publisher.load_dead_keys()
        with self.engine.connect() as conn:
            self.handover.resume(conn)
        self.resume.started(reader, took_over=took_over)

    def step(self, reader: LogReader) -> None:
        """Read what arrived, publish one batch, confirm; keep the reader alive while down."""
        if not self.breaker.ready():
            # Broker down: publish nothing, spend nothing; read on while memory allows
            # (what waits is then held, and reported), then only answer keepalives.
            wait = min(0.2, max(0.01, self.breaker.until_probe()))
            if self._read(reader, wait) == 0 and self.held >= self.max_backlog:
                reader.keep_alive()
                self.control.sleep(wait)
            self._finish_step(reader)
            return
        now = time.monotonic()
        due = self.lanes.next_due()
        wait = READ_WAIT if due is None else min(READ_WAIT, max(0.0, due - now))
        self._read(reader, wait)
        if self.handover.due():
            self.publisher.publish_deferred()
        batch = self.lanes.due(time.monotonic(), self.batch_size)
        if batch and self.breaker.state.up:  # (publishing deferred rows may have found it down)
            self.publisher.publish(batch)
        elif self.held >= self.max_backlog:
            # Full, and every lane waits for a retry: answer the server, then wait for it.
            reader.keep_alive()
            self.control.sleep(wait)
        self._finish_step(reader)

    def _read(self, reader: LogReader, wait: float) -> int:
        """Take in transactions until a batch's worth, the backlog or the wait is reached."""
        taken = 0
        last: datetime | None = None
        while self.held < self.max_backlog and taken < self.batch_size:
            txn = reader.read(wait)
            if txn is None:
                self._behind_at = None  # the log had nothing more
                return taken
            before = self.held
            self.publisher.intake(txn)
            last = txn.committed_at
            # Events against the batch; an eventless transaction counts one (the loop ends).
            taken += max(1, self.held - before)
            wait = 0.0
        # Stopped at a limit: what waits unread committed after the last transaction read.
        self._behind_at = last
        return taken

    def _finish_step(self, reader: LogReader) -> None:
        if self._confirm(reader):
            self.reports.confirmed()
        self._note_oldest()
        now = time.monotonic()
        if self.reports.due(now):
            self.report(reader)
        if self._cleanup.due(now):
            self.cleanup()
        self._last_cycle_at = time.time()

    def report(self, reader: LogReader, *, durable: bool = False) -> None:
        """Write this relay's progress in ``<table>_wal`` (:meth:`Reports.write`)."""
        self.reports.write(
            reader,
            held=self.held,
            oldest=self.oldest_unpublished,
            published=self.published,
            durable=durable,
        )

    def published_last_minute(self) -> int:
        """Events published in about the last minute (since the start, if sooner)."""
        return self.reports.rate.last_minute(self.published)

    def cleanup(self) -> int:
        """Delete rows older than ``cleanup_after`` whatever their state but dead (at most
        10 batches): their events came from the log (:meth:`LogTable.cleanup`)."""
        table = self.source.table
        with self.engine.connect() as conn:
            total = delete_in_batches(
                lambda n: table.cleanup(conn, older_than=self.settings.cleanup_after, batch=n),
                batch=self.settings.cleanup_batch,
                max_batches=10,
            )
        if total:
            log.info("cleanup removed %d relayed rows", total, extra={"count": total})
        return total

    def _forget(self) -> None:
        """Drop the reader and everything read from it (it comes again from the source)."""
        reader = self.reader
        if reader is not None:
            self.resume.stopped(reader)
            reader.close()
            self.reader = None
        self.lanes.clear()

    def close(self) -> None:
        """Close the reader (nothing unconfirmed is confirmed), the presence row's
        connection and the broker."""
        self._forget()
        self.presence.connections.close_all()
        self.close_broker()


def _connection_error(exc: BaseException) -> bool:
    """A lost or refused connection (expected while the server restarts), not an error
    of its own that a log line must show each time."""
    if isinstance(exc, DatabaseError):
        return exc.unreachable or isinstance(exc.__cause__, sa.exc.OperationalError)
    return isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) or bool(
        getattr(exc, "connection_invalidated", False)
    )
