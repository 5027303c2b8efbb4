"""A fleet's parts per database and per outbox: :class:`Database` and :class:`Lane`.

A :class:`Database` holds what the outboxes of one database share: its
connections (one per thread, as a relay's), its breaker (a database that is
down is skipped, and tried again with backoff, while the others go on), and
its settle threads (a settle retrying through that database's restart holds
none of the others'). A :class:`Lane` is one outbox: a relay's
:class:`~outbox_core.relay.cycle.Cycle` on its table, sharing the fleet's
broker and the database's connections, and its row in that outbox's
presence table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.errors import DatabaseError
from outbox_core.fleet.targets import Member
from outbox_core.message import CycleResult, Outcome
from outbox_core.outbox import Outbox
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.claims import ClaimLimits, claimer_for
from outbox_core.relay.connections import RETRY_FIRST, RETRY_MAX, Connections
from outbox_core.relay.control import Control
from outbox_core.relay.cycle import Cycle, CycleParts
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.leases import Claim, Leases
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.presence import Presence
from outbox_core.retry import Backoff, RetryPolicy

log = logging.getLogger("outbox.relay")

#: Settles in flight per database, each on its own thread and connection: as many as the
#: fleet's claims in flight (``FLEET_DEPTH``), so a busy database settles as fast as it
#: is claimed from (one settle thread held a fleet over 50 outboxes to 0.3 of one relay).
SETTLES_PER_DATABASE = 4


class Database:
    """What the outboxes of one database share: connections, a breaker, settle threads."""

    def __init__(
        self,
        key: str,
        base: Outbox,
        settings: Settings,
        control: Control,
        observers: Sequence[RelayObserver],
    ) -> None:
        #: The database's URL, password masked.
        self.key = key
        self.base = base
        self.engine = base.engine
        self.dialect: Dialect = base.dialect
        self.connections = Connections(
            self.engine,
            base.dialect,
            SessionLimits.for_lease(settings.lease),
            ordered=settings.ordered,
            stop=control.stop_requested,
            observers=observers,
        )
        #: The outboxes of this database, by label.
        self.lanes: dict[str, Lane] = {}
        #: Its outboxes were looked for successfully at least once.
        self.discovered = False
        self._backoff = Backoff(RETRY_FIRST, RETRY_MAX, jitter=0.2)
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._settler = ThreadPoolExecutor(
            SETTLES_PER_DATABASE, thread_name_prefix="outbox-settle-db"
        )
        self._settles = threading.BoundedSemaphore(SETTLES_PER_DATABASE)

    # -- the breaker ------------------------------------------------------------------

    def ready(self) -> bool:
        """Not in a backoff after a failure: its outboxes may be claimed from."""
        return time.monotonic() >= self._retry_at

    def failed(self, exc: DatabaseError) -> float:
        """A statement failed: skip this database for a backoff step (logged once per
        outage by the connections); return the wait."""
        with self._lock:
            wait = self._backoff.next()
            self._retry_at = time.monotonic() + wait
        self.connections.log_failure(exc, f"{self.key}: ", wait)
        return wait

    def answered(self) -> None:
        """A statement succeeded: the backoff starts again from its first step."""
        if self._retry_at:
            with self._lock:
                self._backoff.reset()
                self._retry_at = 0.0

    # -- settles ----------------------------------------------------------------------

    def settle(
        self, lane: Lane, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> Future[None]:
        """Settle ``claim`` on this database's own thread.

        Waits only while two of this database's settles are in flight: a
        settle retrying through this database's restart holds its own
        database's claims back, not the other databases'.
        """
        self._settles.acquire()
        future = self._settler.submit(lane.cycle.settle_and_finish, claim, outcomes, result)
        future.add_done_callback(lambda _: self._settles.release())
        return future

    def close(self) -> None:
        """Wait for the settles in flight; close the connections."""
        self._settler.shutdown(wait=True)
        self.connections.close_all()


class Lane:
    """One outbox of a fleet: its cycle, its presence row and what the fleet knows of it."""

    def __init__(
        self,
        member: Member,
        database: Database,
        *,
        relay_id: str,
        settings: Settings,
        retry: RetryPolicy,
        broker: Broker,
        breaker: Breaker,
        control: Control,
        observers: list[RelayObserver],
        depth: int,
    ) -> None:
        self.label = member.label
        self.member = member
        self.database = database
        self.dialect: Dialect = member.outbox.dialect
        connections = database.connections
        batch_size = min(settings.batch_size, self.dialect.max_batch)
        runs = settings.ordered and settings.run_length > 1
        #: The relay's cycle on this outbox's table.
        self.cycle = Cycle(
            CycleParts(
                name=relay_id,
                settings=settings,
                dialect=self.dialect,
                retry=retry,
                connections=connections,
                leases=Leases(self.dialect, connections, settings.lease),
                claimer=claimer_for(
                    settings,
                    self.dialect,
                    connections,
                    ClaimLimits(batch_size, settings.lease, settings.batch_bytes),
                    membership=None,
                    lanes=depth,
                ),
                delivery=Delivery(broker, breaker, ordered=settings.ordered, runs=runs),
                breaker=breaker,
                observers=observers,
                control=control,
            )
        )
        #: The fleet's row in this outbox's presence table.
        self.presence = Presence(
            relay_id,
            settings.ordering,
            self.dialect.presence,
            connections,
            control,
            interval=settings.heartbeat,
        )
        observers.append(self.presence.counts)
        #: Batches claimed and not yet settled or given back (by token).
        self.in_flight: set[str] = set()
        #: Found gone (its schema dropped, or it no longer matches): no new claims.
        self.retired = False
        # A failure of this outbox's own (its table dropped or unreadable while the
        # database answers): it is left out until this backoff passes.
        self._failures = Backoff(RETRY_FIRST * 10, 60.0, jitter=0.2)
        self._left_out_until = 0.0
        #: The probe saw leases that ran out here: reap when due.
        self.reap_wanted = False
        #: Events were settled since the last cleanup here (a first one runs at start).
        self.cleanup_wanted = True
        #: ``time.monotonic()`` of the last claim that took events, and of the last beat.
        self.busy_at = 0.0
        self.beat_at = float("-inf")

    def __repr__(self) -> str:
        return f"Lane({self.label!r})"

    def left_out(self) -> bool:
        """Retired, or in a backoff after a failure of its own."""
        return self.retired or time.monotonic() < self._left_out_until

    def failed(self, exc: DatabaseError) -> None:
        """A statement on this outbox failed while its database answers: leave it out for
        a backoff step (its database and the other outboxes go on)."""
        wait = self._failures.next()
        self._left_out_until = time.monotonic() + wait
        log.warning("outbox %s: %s; left out for %.0fs", self.label, exc, wait)

    def answered(self) -> None:
        """A statement on this outbox succeeded."""
        if self._left_out_until:
            self._failures.reset()
            self._left_out_until = 0.0

    @property
    def channel(self) -> str:
        """The channel this outbox's producers notify on (PostgreSQL)."""
        return self.dialect.enqueue.notify_channel()
