"""The steps of a fleet's cycles: each batch claimed from the outbox whose turn it is.

:class:`FleetCycle` is what the relay's
:class:`~outbox_core.relay.pipeline.Pipeline` drives for many outboxes: a
claim goes to the outboxes with work in turn (:class:`~outbox_core.fleet.rota.Rota`);
publishing, settling and giving back go to the cycle of the outbox the batch
came from. Which outboxes have work is learnt from one probe statement per
database (every poll interval while any is busy, at each idle poll when none
is) and from NOTIFY wake-ups naming their outbox. Every guarantee is the
outbox's own cycle's: the fleet only chooses which cycle claims next.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from outbox_core.config import Settings
from outbox_core.dialects.base.discovery import Due, Probe, probe
from outbox_core.errors import DatabaseError
from outbox_core.fleet.lanes import Database, Lane
from outbox_core.fleet.rota import Rota
from outbox_core.fleet.targets import weight_of
from outbox_core.message import CycleResult, Outcome
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.control import Control
from outbox_core.relay.leases import Claim
from outbox_core.relay.observers import RelayObserver

log = logging.getLogger("outbox.relay")


class FleetCycle:
    """The steps :class:`~outbox_core.relay.pipeline.Pipeline` drives, over many outboxes."""

    def __init__(
        self,
        settings: Settings,
        databases: Sequence[Database],
        breaker: Breaker,
        control: Control,
        observers: list[RelayObserver],
    ) -> None:
        self.settings = settings
        self.databases = list(databases)
        self.breaker = breaker
        self.control = control
        #: The fleet's observers (each outbox's cycle has its own, labelled).
        self.observers = observers
        self.rota = Rota()
        #: ``time.time()`` of the last finished cycle.
        self.finished_at = 0.0
        self._owners: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        self._probed_at = float("-inf")
        self._finish_lock = threading.Lock()
        self._probes: dict[str, tuple[tuple[int, ...], Probe]] = {}
        #: Statements the probes ran (for the idle cost's benchmark and tests).
        self.probes = 0
        #: Find the outboxes again now (set by the fleet: a table met was gone).
        self.rediscover: Callable[[], None] = lambda: None

    # -- the outboxes -----------------------------------------------------------------

    def lanes(self) -> list[Lane]:
        """Every outbox of the fleet now."""
        return [lane for db in self.databases for lane in list(db.lanes.values())]

    def lane(self, label: str) -> Lane | None:
        """The outbox ``label``, if the fleet has it."""
        for db in self.databases:
            found = db.lanes.get(label)
            if found is not None:
                return found
        return None

    def wake(self, labels: Iterable[str]) -> None:
        """These outboxes have work now (a NOTIFY named them): claim at once."""
        woke = False
        for label in labels:
            lane = self.lane(label)
            if lane is not None and not lane.retired:
                self.rota.add(label, weight_of(label, self.settings.weights))
                woke = True
        if woke:
            self.control.wake()

    # -- what the pipeline asks ---------------------------------------------------------

    @property
    def ordered(self) -> bool:
        """Per-key order inside each outbox (by heads: every claim proves its keys' heads)."""
        return self.settings.ordered

    @property
    def waits_for_settle(self) -> bool:
        """Ordered: a claim ahead of time waits for the settle in progress (as a relay's)."""
        return self.settings.ordered

    def owner(self, claim: Claim) -> Lane:
        """The outbox ``claim`` came from."""
        with self._lock:
            return self._owners[claim.token]

    def stale(self, claim: Claim) -> bool:
        """See :meth:`Cycle.stale <outbox_core.relay.cycle.Cycle.stale>`."""
        return self.owner(claim).cycle.stale(claim)

    def revalidate(self, claim: Claim) -> Claim:
        """See :meth:`Cycle.revalidate <outbox_core.relay.cycle.Cycle.revalidate>`."""
        lane = self.owner(claim)
        try:
            return lane.cycle.revalidate(claim)
        except DatabaseError as exc:
            lane.database.failed(exc)
            return Claim(claim.token, [])  # its leases run out; a reaper returns them

    def log_failure(self, exc: DatabaseError, wait: float) -> None:
        """Claims fail per database and are logged there: nothing reaches the pipeline."""
        log.error("%s; retrying in %.1fs", exc, wait)

    # -- the steps ----------------------------------------------------------------------

    def claim(self) -> Claim:
        """Tx 1 on the outbox whose turn it is: the first in turn that has a batch.

        An outbox whose claim finds nothing leaves the ring; a database that
        fails is skipped for a backoff step (its breaker) and the next outbox
        is tried. ``more`` is set while any outbox has work, so the pipeline
        claims ahead.
        """
        self.probe_when_due()
        passed: set[str] = set()
        while (label := self.rota.pick(passed)) is not None:
            passed.add(label)
            lane = self.lane(label)
            if lane is None or lane.left_out():
                self.rota.drop(label)
                continue
            if not lane.database.ready():
                # Its database is in a backoff: the probe puts it back once it answers.
                self.rota.drop(label)
                continue
            try:
                claim = lane.cycle.claim()
            except DatabaseError as exc:
                # Unreachable: the database's breaker; else this outbox's own
                # failure (its table dropped): it alone is left out.
                if exc.unreachable:
                    lane.database.failed(exc)
                else:
                    lane.failed(exc)
                    self.rediscover()
                self.rota.drop(label)
                continue
            lane.database.answered()
            lane.answered()
            if not claim.events:
                self.rota.drop(label)
                continue
            if not claim.more:
                self.rota.drop(label)
            with self._lock:
                self._owners[claim.token] = lane
                lane.in_flight.add(claim.token)
            lane.busy_at = time.monotonic()
            claim.more = claim.more or len(self.rota) > 0
            return claim
        return Claim("", [])

    def probe_when_due(self, *, force: bool = False) -> int:
        """Look for outboxes with work: one statement per database.

        Due every poll interval while outboxes are busy (a quiet outbox's
        fresh event waits at most that), and at each claim when none is (the
        pipeline's idle waits space those). Returns the outboxes found.
        """
        now = time.monotonic()
        busy = len(self.rota) > 0
        if busy and not force and now - self._probed_at < self.settings.poll_interval:
            return 0
        if not self._probing.acquire(blocking=False):
            return 0  # another claim thread is probing
        try:
            self._probed_at = now
            return sum(self._probe(db) for db in self.databases if db.ready())
        finally:
            self._probing.release()

    def _probe(self, db: Database) -> int:
        lanes = [lane for lane in db.lanes.values() if not lane.left_out()]
        if not lanes:
            return 0
        key = tuple(id(lane) for lane in lanes)
        if self._probes.get(db.key, (None,))[0] != key:
            # Built once while the database's outboxes stay the same (see Probe).
            self._probes[db.key] = (key, Probe([lane.dialect for lane in lanes]))
        try:
            found = db.connections.call("probe", self._probes[db.key][1])
        except DatabaseError as exc:
            if exc.unreachable:
                db.failed(exc)
                return 0
            # The database answers, but an outbox's table is gone (a schema
            # dropped) or unreadable: find the outboxes again, and probe each
            # alone so that one tenant's table stalls no other.
            self.rediscover()
            lanes, found = self._probe_apart(db)
        finally:
            self.probes += 1
        db.answered()
        for due in found:
            lane = lanes[due.index]
            if due.pending:
                self.rota.add(lane.label, weight_of(lane.label, self.settings.weights))
            if due.expired:
                lane.reap_wanted = True
        return sum(1 for due in found if due.pending)

    def _probe_apart(self, db: Database) -> tuple[list[Lane], list[Due]]:
        """Probe each outbox of ``db`` alone; leave out those that fail."""
        lanes = [lane for lane in db.lanes.values() if not lane.left_out()]
        found: list[Due] = []
        for index, lane in enumerate(lanes):
            try:
                answers = db.connections.call("probe", probe, [lane.dialect])
            except DatabaseError as exc:
                if exc.unreachable:
                    db.failed(exc)
                    break
                lane.failed(exc)
                continue
            lane.answered()
            found += [dataclasses.replace(due, index=index) for due in answers]
        return lanes, found

    def publish(
        self, claim: Claim, *, interrupted: Callable[[], object] | None = None
    ) -> Sequence[Outcome | None]:
        """Publish the batch through its outbox's cycle (the fleet's one broker)."""
        lane = self.owner(claim)
        return lane.cycle.publish(claim, interrupted=interrupted or (lambda: self.release(claim)))

    def settle_and_finish(
        self, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> None:
        """Hand the settle to its database's settle thread (never raises).

        Returns once it is queued: a settle retrying through one database's
        restart holds no other database's batches.
        """
        lane = self.owner(claim)
        future = lane.database.settle(lane, claim, outcomes, result)
        future.add_done_callback(lambda _: self._settled(lane, claim, result))

    def _settled(self, lane: Lane, claim: Claim, result: CycleResult) -> None:
        lane.cleanup_wanted = True
        self._forget(lane, claim.token)
        self.finished_at = time.time()

    def release(self, claim: Claim) -> int:
        """Give the batch's claims back to its outbox, unspent."""
        if not claim.token:
            return 0
        lane = self.owner(claim)
        try:
            return lane.cycle.release(claim)
        finally:
            self._forget(lane, claim.token)

    def forget(self, token: str) -> None:
        """``token``'s batch is settled or given back."""
        with self._lock:
            lane = self._owners.get(token)
        if lane is not None:
            lane.cycle.forget(token)
            self._forget(lane, token)

    def _forget(self, lane: Lane, token: str) -> None:
        with self._lock:
            self._owners.pop(token, None)
            lane.in_flight.discard(token)

    def finish_quietly(self, result: CycleResult) -> None:
        """Report a cycle that claimed nothing (the fleet's observers)."""
        with self._finish_lock:
            self.finished_at = time.time()
            for observer in self.observers:
                try:
                    observer.cycle(result)
                except Exception:
                    log.exception("an observer failed")
