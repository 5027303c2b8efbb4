"""The :class:`Relay` facade: the public API of a polling relay, and the wiring of its parts.

What one cycle does is :mod:`~outbox_core.relay.cycle`'s; how ``run()``
overlaps cycles is :mod:`~outbox_core.relay.pipeline`'s; the claim strategy
is :mod:`~outbox_core.relay.claims`'; the side tasks (maintenance,
heartbeats, LISTEN) are :mod:`~outbox_core.relay.background`'s, and the
relay's row in the presence table :mod:`~outbox_core.relay.presence`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.message import CycleResult
from outbox_core.redaction import redact
from outbox_core.relay.background import Heartbeats, Listener, Maintenance
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.claims import Claimer, ClaimLimits, Membership, claimer_for
from outbox_core.relay.connections import Connections
from outbox_core.relay.control import Control
from outbox_core.relay.cycle import Cycle, CycleParts
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.leases import Leases
from outbox_core.relay.lifecycle import ClosableRelay
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.pipeline import run_pipeline
from outbox_core.relay.presence import Presence, unique_id
from outbox_core.relay.schedule import Task
from outbox_core.relay.signals import stop_on_signals
from outbox_core.relay.state import BrokerState, DatabaseState
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")


def default_relay_name() -> str:
    """A relay's name when none is given: host, process and a random suffix."""
    host = socket.gethostname().split(".")[0][:20]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Relay(ClosableRelay):
    """Moves events from the outbox table to a broker.

    Create it with :meth:`outbox_core.Outbox.relay`. ``run()`` blocks until
    :meth:`stop` or a signal; ``run_once()`` does one cycle and returns what
    it did (for tests and for embedding in a scheduler). As a context
    manager it is closed on exit. Its :attr:`cycle` holds the steps every
    loop drives.
    """

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        broker: Broker,
        settings: Settings,
        *,
        name: str | None = None,
        retry_policy: RetryPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.broker = broker
        self.settings = settings
        self.name = name or default_relay_name()
        #: This relay's id in the presence table and (ordered by key partitions) the
        #: membership table: unique per Relay object, whatever --name says.
        self.relay_id = unique_id(self.name)
        retry = retry_policy or RetryPolicy(
            max_attempts=settings.max_attempts,
            base=settings.backoff_base,
            cap=settings.backoff_cap,
        )
        self.batch_size = min(settings.batch_size, dialect.max_batch)
        #: Server-side bounds on every relay connection (see SessionSetup.configure).
        self.limits = SessionLimits.for_lease(settings.lease)
        #: Metrics and tracing hooks, called in order (see :class:`RelayObserver`).
        self.observers: list[RelayObserver] = []
        self.control = Control()
        self.connections = Connections(
            engine,
            dialect,
            self.limits,
            ordered=settings.ordered,
            stop=self.control.stop_requested,
            observers=self.observers,
        )
        #: Ordered by key partitions: this relay's row among the ordered relays.
        self.membership: Membership | None = None
        if settings.ordering == "partitions":
            self.membership = Membership(
                self.relay_id,
                dialect,
                self.connections,
                heartbeat=settings.heartbeat,
                stale_after=settings.stale_after,
            )
        #: The claim strategy ``settings.ordering`` names, chosen once.
        self.claimer: Claimer = claimer_for(
            settings,
            dialect,
            self.connections,
            ClaimLimits(self.batch_size, settings.lease, settings.batch_bytes),
            membership=self.membership,
            lanes=self.claim_depth,
        )
        #: This relay's row in the presence table, written while ``run()`` runs.
        self.presence = self._presence()
        breaker = Breaker(broker, self.observers)
        runs = settings.ordered and settings.run_length > 1
        #: The steps of one cycle, which every loop of this relay drives.
        self.cycle = Cycle(
            CycleParts(
                name=self.name,
                settings=settings,
                dialect=dialect,
                retry=retry,
                connections=self.connections,
                leases=Leases(dialect, self.connections, settings.lease),
                claimer=self.claimer,
                delivery=Delivery(broker, breaker, ordered=settings.ordered, runs=runs),
                breaker=breaker,
                observers=self.observers,
                control=self.control,
            )
        )

    def _presence(self) -> Presence:
        """This relay's row in the presence table, its counts among the observers."""
        presence = Presence(
            self.relay_id,
            self.settings.ordering,
            self.dialect.presence,
            self.connections,
            self.control,
            interval=self.settings.heartbeat,
        )
        self.observers.append(presence.counts)
        return presence

    # -- state ------------------------------------------------------------------------

    @property
    def retry(self) -> RetryPolicy:
        """Attempts and backoff of failed events."""
        return self.cycle.retry

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up? Changed only by the publishing thread."""
        return self.cycle.breaker.state

    @property
    def database_state(self) -> DatabaseState:
        """Could the database be reached at the relay's last statement?"""
        return self.connections.state

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished cycle or broker probe (health checks)."""
        return max(self.cycle.finished_at, self.cycle.breaker.probed_at)

    @property
    def conn(self) -> Connection:
        """This thread's connection of the relay, opened on first use and after a failure."""
        return self.connections.get()

    @property
    def claim_depth(self) -> int:
        """Claims (and settles) ``run()`` keeps in flight while a batch is published.

        Two on databases with row locks: each on its own connection, one
        claim's round trip overlaps the other's row decoding, which alone
        kept the database waiting on Python between claims; likewise two
        settles. In ordered mode the two claims keep apart as two relays do:
        by heads, a key whose head one holds is skipped by the other; by key
        partitions, each claims its own lane of the relay's partitions
        (:class:`~outbox_core.relay.claims.lanes.Lanes`). One on SQLite,
        whose claims take turns anyway.
        """
        return 2 if self.dialect.row_locks else 1

    # -- one cycle and maintenance ------------------------------------------------------

    def run_once(self) -> CycleResult:
        """Reap (when due), claim one batch, publish it, settle it, clean up (when due).

        While the broker is down it claims nothing: it probes the broker (at
        most once per backoff step) and returns an empty cycle.
        """
        return self.cycle.run_once()

    def keep_leases(self) -> int:
        """Renew the leases of batches in flight whose lease is a third gone; return how many."""
        return self.cycle.keep_leases()

    def reap(self) -> int:
        """Return expired leases to pending (skipping rows other sessions hold)."""
        return self.cycle.reap()

    def cleanup(self) -> int:
        """Delete sent rows older than ``cleanup_after``, in bounded batches (at most 10)."""
        return self.cycle.cleanup()

    # -- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in flight (thread-safe)."""
        self.control.stop()

    def wake(self) -> None:
        """Claim now instead of waiting for the poll interval (thread-safe)."""
        self.control.wake()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self.control.stopping

    def _check_ordered(self) -> None:
        """Refuse to relay in order where the database cannot serve ordered claims.

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` (SQL Server
        without READ_COMMITTED_SNAPSHOT). A database that cannot be reached
        yet is not refused: the relay waits for it as always, and checks on
        its first connection, before its first claim (:attr:`conn`).
        """
        try:
            with self.engine.connect() as conn:
                self.dialect.check_ordered(conn)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("database not reachable yet (%s); checking on connect", redact(str(exc)))
            return
        self.connections.ordered_checked = True

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally (exit code 0)."""
        if not self.connections.ordered_checked:
            self._check_ordered()
        try:
            with stop_on_signals(self.stop, install=install_signal_handlers):
                log.info(
                    "relay %s started (%s, batch %d, lease %.0fs%s)",
                    self.name,
                    self.dialect.name,
                    self.batch_size,
                    self.settings.lease,
                    f", ordered by {self.settings.ordering}" if self.settings.ordered else "",
                )
                self.cycle.breaker.probe_at_start()
                self._run_loop()
        finally:
            self.close()
            log.info("relay %s stopped", self.name)

    def side_tasks(self) -> list[Task]:
        """The tasks ``run()`` starts beside its loop: maintenance, heartbeats, LISTEN, and
        the relay's row in the presence table."""
        tasks: list[Task] = [Maintenance(self.cycle), self.presence]
        if self.membership is not None:
            tasks.append(Heartbeats(self.membership, self.control, self.connections))
        if self.settings.notify:
            tasks.append(Listener(self.dialect, self.engine, self.control, self.connections))
        return tasks

    def _run_loop(self) -> None:
        """The pipeline on this thread, the side tasks beside it; join them on exit."""
        run_pipeline(self.cycle, self.side_tasks(), depth=self.claim_depth)

    def close(self) -> None:
        """Leave the ordered relays (handing over partitions); close connections and broker."""
        if self.membership is not None:
            self.membership.leave()
        self.connections.close_all()
        self.close_broker()
