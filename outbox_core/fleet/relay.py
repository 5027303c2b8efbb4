""":class:`FleetRelay`: one relay over many outboxes (schemas, databases, kinds of database).

It is a relay's loop (:class:`~outbox_core.relay.pipeline.Pipeline`) driving
:class:`~outbox_core.fleet.cycle.FleetCycle`, which claims from the outboxes
in turn; each outbox has a relay's own cycle on its table (claims, fencing,
per-key order, at-least-once are that cycle's), and each database its own
connections and breaker. Outboxes added to or removed from a pattern of
schemas are found every ``discover_interval``: a new one is served at once,
a removed one after its batches in flight are settled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError, DatabaseError, OutboxError
from outbox_core.fleet.cycle import FleetCycle
from outbox_core.fleet.labelled import LabelBound, Labelled
from outbox_core.fleet.lanes import Database, Lane
from outbox_core.fleet.targets import Databases, Member, label, table_of
from outbox_core.fleet.tasks import Beats, Upkeep, Wakeups
from outbox_core.message import CycleResult
from outbox_core.redaction import mask_url
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.control import Control
from outbox_core.relay.facade import default_relay_name
from outbox_core.relay.lifecycle import ClosableRelay
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.pipeline import run_pipeline
from outbox_core.relay.presence import unique_id
from outbox_core.relay.schedule import Task
from outbox_core.relay.signals import stop_on_signals
from outbox_core.relay.state import BrokerState, DatabaseState
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")

#: Claims a fleet keeps in flight (a relay: two). Its claims are on many tables, so
#: they do not contend; with two, a fleet over 50 outboxes drained 0.89 of one
#: relay over one outbox, with four 1.10 (bench/many_outboxes.py, the same run).
FLEET_DEPTH = 4


class FleetRelay(ClosableRelay):
    """Moves events from many outboxes to one broker, fairly.

    ``settings`` name the outboxes (``database_url`` and ``database_urls``,
    ``schema`` or a ``schemas`` pattern, ``table``) and how to relay them,
    as for one relay; ``weights`` give an outbox more batches per turn.
    Per-key order is kept inside each outbox by heads (``ordering =
    "heads"``); ``partitions`` is refused, its membership being per table.
    ``run()`` blocks until :meth:`stop` or a signal; ``run_once()`` claims
    one batch from the outbox whose turn it is.
    """

    def __init__(
        self,
        settings: Settings,
        broker: Broker,
        *,
        name: str | None = None,
        retry_policy: RetryPolicy | None = None,
        databases: Databases | None = None,
    ) -> None:
        if settings.ordering == "partitions":
            raise ConfigurationError(
                "many outboxes keep per-key order by heads: pass --ordering heads (key "
                "partitions need a membership, and its heartbeats, per outbox)"
            )
        self.settings = settings
        self.broker = broker
        self.name = name or default_relay_name()
        #: The fleet's id in each outbox's presence table.
        self.relay_id = unique_id(self.name)
        self.retry = retry_policy or RetryPolicy(
            max_attempts=settings.max_attempts, base=settings.backoff_base, cap=settings.backoff_cap
        )
        self.control = Control()
        #: The fleet's observers; each outbox's cycle tells them through :class:`Labelled`.
        self.observers: list[RelayObserver] = []
        self.breaker = Breaker(broker, self.observers)
        #: The outbox names metrics carry (the first ``metrics_outboxes``; then ``other``).
        self.label_bound = LabelBound(settings.metrics_outboxes)
        self.catalog = databases or Databases(settings)
        self.databases = [
            Database(mask_url(base.url), base, settings, self.control, self.observers)
            for base in self.catalog
        ]
        self.cycle = FleetCycle(
            settings, self.databases, self.breaker, self.control, self.observers
        )
        self._discover_lock = threading.Lock()
        self.cycle.rediscover = self.discover
        self.discover()

    # -- the outboxes -------------------------------------------------------------------

    @property
    def lanes(self) -> list[Lane]:
        """Every outbox served now."""
        return self.cycle.lanes()

    @property
    def labels(self) -> list[str]:
        """The names of the outboxes served now."""
        return [lane.label for lane in self.lanes if not lane.retired]

    def discover(self, *, only_missing: bool = False) -> None:
        """Find the outboxes now (one statement per database): serve the new, let the gone go.

        A database that cannot be reached keeps what was found before and is
        looked at again at the next discovery; ``only_missing``: only the
        databases never looked at successfully (down when the relay started).
        """
        with self._discover_lock:
            for db in self.databases:
                if only_missing and db.discovered:
                    continue
                if not db.ready():
                    continue
                try:
                    names = db.connections.call("discover", self.catalog.names_in, db.base)
                except (DatabaseError, OutboxError) as exc:
                    if isinstance(exc, DatabaseError):
                        db.failed(exc)
                    else:
                        log.warning("%s: finding outboxes failed: %s", db.key, exc)
                    continue
                if not db.discovered and not names and self.settings.schemas is not None:
                    log.warning(
                        "%s: no schema matching %s holds table %s (looked again every %.0fs)",
                        db.key,
                        self.settings.schemas,
                        self.settings.table,
                        self.settings.discover_interval,
                    )
                db.discovered = True
                self._update(db, names)

    def _update(self, db: Database, names: Sequence[str | None]) -> None:
        current = {lane.member.schema: lane for lane in db.lanes.values()}
        # Two URLs of one MySQL server (or one PostgreSQL database) list the same
        # schemas: each table is served once, by the first URL that found it.
        elsewhere = {
            table_of(other.base, lane.member.schema)
            for other in self.databases
            if other is not db
            for lane in other.lanes.values()
        }
        names = [n for n in names if table_of(db.base, n) not in elsewhere or n in current]
        new = [n for n in names if n not in current]
        gone = [lane for schema, lane in current.items() if schema not in names]
        if new:
            members = self.catalog.members_in(db.base, new)
            self._label(members)
            for member in members:
                db.lanes[member.label] = self._lane(member, db)
                log.info("relaying outbox %s (%s)", member.label, member.outbox.table.fullname)
                # A new outbox may hold events already: the next probe tells.
        for lane in gone:
            if not lane.retired:
                lane.retired = True
                self.cycle.rota.drop(lane.label)
                log.info("outbox %s is gone or no longer matches: no more claims", lane.label)
        for lane in [lane for lane in db.lanes.values() if lane.retired and not lane.in_flight]:
            del db.lanes[lane.label]
            Beats.leave(lane)

    def _label(self, members: list[Member]) -> None:
        """Label new members uniquely among every outbox served (old labels are kept)."""
        old = [lane.member for lane in self.lanes]
        taken = {m.label for m in old}
        label([*old, *members])
        for m in old:  # label() may have qualified old ones: give them back their names
            m.label = next(lane.label for lane in self.lanes if lane.member is m)
        for m in members:
            base, n = m.label, 1
            while m.label in taken:
                n += 1
                m.label = f"{base}#{n}"
            taken.add(m.label)

    def _lane(self, member: Member, db: Database) -> Lane:
        return Lane(
            member,
            db,
            relay_id=self.relay_id,
            settings=self.settings,
            retry=self.retry,
            broker=self.broker,
            breaker=self.breaker,
            control=self.control,
            observers=[Labelled(self.observers, member.label, self.label_bound)],
            depth=self.claim_depth,
        )

    # -- state --------------------------------------------------------------------------

    @property
    def claim_depth(self) -> int:
        """Claims ``run()`` keeps in flight: :data:`FLEET_DEPTH` where every database has row
        locks; one on SQLite, whose claims take turns anyway."""
        return FLEET_DEPTH if all(db.dialect.row_locks for db in self.databases) else 1

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up?"""
        return self.breaker.state

    @property
    def database_state(self) -> DatabaseState:
        """The first database found down, else the first database's state."""
        states = [db.connections.state for db in self.databases]
        return next((s for s in states if not s.up), states[0])

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished cycle or broker probe (health checks)."""
        return max(self.cycle.finished_at, self.breaker.probed_at)

    # -- running ------------------------------------------------------------------------

    def run_once(self) -> CycleResult:
        """Look for work (one statement per database), then claim, publish and settle one
        batch from the outbox whose turn it is."""
        if not self.breaker.ready():
            return CycleResult()
        claim = self.cycle.claim()  # looks for work first when none is known or a poll is due
        result = CycleResult(claimed=len(claim.events))
        if not claim.events:
            return result
        lane = self.cycle.owner(claim)
        try:
            return lane.cycle.settle(claim, self.cycle.publish(claim), result)
        finally:
            self.cycle.forget(claim.token)

    def stop(self) -> None:
        """Ask ``run()`` to return after the batches in flight (thread-safe)."""
        self.control.stop()

    def wake(self) -> None:
        """Probe and claim now instead of waiting for the poll interval (thread-safe)."""
        self.control.wake()

    def side_tasks(self) -> list[Task]:
        """Upkeep, the presence rows, and LISTEN per database where notifications exist."""
        tasks: list[Task] = [Upkeep(self.cycle, self.discover), Beats(self.cycle)]
        if self.settings.notify:
            tasks += [Wakeups(self.cycle, db) for db in self.databases]
        return tasks

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally."""
        try:
            with stop_on_signals(self.stop, install=install_signal_handlers):
                log.info(
                    "relay %s started over %d outboxes in %d databases (batch %d, lease %.0fs%s)",
                    self.name,
                    len(self.labels),
                    len(self.databases),
                    self.settings.batch_size,
                    self.settings.lease,
                    ", ordered by heads" if self.settings.ordered else "",
                )
                self.breaker.probe_at_start()
                run_pipeline(self.cycle, self.side_tasks(), depth=self.claim_depth)
        finally:
            self.close()
            log.info("relay %s stopped", self.name)

    def close(self) -> None:
        """Wait for the settles in flight; close every database's connections, the broker."""
        for db in self.databases:
            db.close()
        self.catalog.close()
        self.close_broker()
