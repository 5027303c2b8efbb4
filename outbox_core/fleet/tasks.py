"""The side tasks of a fleet's ``run()``: upkeep of its outboxes, presence rows, wake-ups.

Each runs on a thread of its own, as a relay's side tasks do, and works
database by database: a database that fails is skipped for its breaker's
backoff, and the others go on.

* :class:`Upkeep`: lease renewals of batches in flight, reaping where the
  probe saw leases run out, cleanup where events were settled, and finding
  outboxes added and removed (``schemas``) every ``discover_interval``.
* :class:`Beats`: the fleet's row in each outbox's presence table, every
  heartbeat where the outbox was busy, every :data:`QUIET_BEAT` otherwise.
* :class:`Wakeups`: one LISTEN connection per database on every outbox's
  channel (PostgreSQL); a notification puts its outbox in the ring at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from outbox_core.errors import DatabaseError
from outbox_core.fleet.cycle import FleetCycle
from outbox_core.fleet.lanes import Database, Lane
from outbox_core.relay.background import LISTEN_FIRST
from outbox_core.relay.connections import RETRY_MAX
from outbox_core.relay.schedule import Every
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: How often the fleet's row is written in an outbox it had no work in, in seconds:
#: under the dashboard's 15 s mark of a stale relay, and a fraction of the
#: writes a beat per heartbeat would cost over hundreds of quiet outboxes.
QUIET_BEAT = 10.0


def fault(db: Database, lane: Lane, exc: DatabaseError) -> None:
    """A statement on ``lane`` failed: its database's breaker if the database is out of
    reach, else that outbox alone is left out for a while (its table dropped)."""
    if exc.unreachable:
        db.failed(exc)
    else:
        lane.failed(exc)


class Upkeep:
    """Renew leases in flight; reap, clean up and rediscover when due (one thread)."""

    name = "outbox-upkeep"
    join_timeout = 30.0

    def __init__(self, cycle: FleetCycle, discover: Callable[..., None]) -> None:
        self.cycle = cycle
        self.discover = discover
        settings = cycle.settings
        self.tick = min(max(settings.lease / 10, 0.05), 1.0)
        self.discovering = Every(settings.discover_interval)
        self.cleaning = Every(settings.cleanup_interval if settings.cleanup_after > 0 else 0)
        self.reap_every = settings.reap_interval
        self._reaped_at: dict[str, float] = {}

    def run(self) -> None:
        """Loop until the fleet stops."""
        while not self.cycle.control.sleep(self.tick):
            try:
                self.once()
            except Exception:
                log.exception("upkeep failed")

    def once(self) -> None:
        """One round over every outbox."""
        now = time.monotonic()
        clean = self.cleaning.due(now)
        for db in self.cycle.databases:
            for lane in list(db.lanes.values()):
                if not db.ready():
                    break
                if lane.left_out():
                    continue
                try:
                    self._lane(lane, now, clean=clean)
                except DatabaseError as exc:
                    fault(db, lane, exc)
        if self.discovering.due(now):
            self.discover()
        elif not all(db.discovered for db in self.cycle.databases):
            # Down when the relay started: found as soon as it answers (its
            # breaker spaces the tries), not a discovery interval later.
            self.discover(only_missing=True)

    def _lane(self, lane: Lane, now: float, *, clean: bool) -> None:
        cycle = lane.cycle
        if lane.in_flight:
            cycle.keep_leases()
        if (
            lane.reap_wanted
            and self.reap_every > 0
            and now - self._reaped_at.get(lane.label, float("-inf")) >= self.reap_every
        ):
            lane.reap_wanted = False
            self._reaped_at[lane.label] = now
            cycle.reap()
        if clean and lane.cleanup_wanted:
            lane.cleanup_wanted = False
            cycle.cleanup()


class Beats:
    """The fleet's row in each outbox's presence table; deleted from each when it stops."""

    name = "outbox-presence"
    join_timeout = 10.0

    def __init__(self, cycle: FleetCycle) -> None:
        self.cycle = cycle
        self.interval = cycle.settings.heartbeat

    def run(self) -> None:
        """Write the rows until the fleet stops, then delete them."""
        wait = 0.0
        while not self.cycle.control.sleep(wait):
            self.once()
            wait = min(self.interval, QUIET_BEAT)
        for lane in self.cycle.lanes():
            self.leave(lane)

    def once(self) -> None:
        """A beat in every outbox that is due one."""
        now = time.monotonic()
        for db in self.cycle.databases:
            for lane in list(db.lanes.values()):
                if not db.ready():
                    break
                busy = lane.busy_at > lane.beat_at
                due = now - lane.beat_at >= (self.interval if busy else QUIET_BEAT)
                if not due or lane.presence.installed is False:
                    continue
                if lane.left_out():
                    continue
                try:
                    lane.presence.tick()
                    lane.beat_at = now
                except DatabaseError as exc:
                    fault(db, lane, exc)

    @staticmethod
    def leave(lane: Lane) -> None:
        """Delete the fleet's row in ``lane``'s presence table (quietly)."""
        if lane.presence.written:
            lane.presence.leave()


class Wakeups:
    """LISTEN on every outbox's channel of one database; a notification wakes its outbox."""

    join_timeout = 5.0

    def __init__(self, cycle: FleetCycle, db: Database) -> None:
        self.cycle = cycle
        self.db = db
        self.name = "outbox-listen"

    def run(self) -> None:
        """Loop until the fleet stops; listen again when the outboxes change."""
        waits = Backoff(LISTEN_FIRST, RETRY_MAX, jitter=0.2)
        control = self.cycle.control
        while not control.stopping:
            lanes = {lane.channel: lane.label for lane in self.db.lanes.values()}
            if not lanes:
                control.sleep(1.0)
                continue
            try:
                listener = self.db.dialect.enqueue.listener(self.db.engine, sorted(lanes))
            except Exception as exc:
                log.debug("LISTEN failed (%s); polling", exc)
                control.sleep(waits.next())
                continue
            if listener is None:
                return  # this database has no notifications: the probe alone
            waits.reset()
            try:
                while not control.stopping and set(lanes) == {
                    lane.channel for lane in self.db.lanes.values()
                }:
                    channels = listener.received(0.5)
                    if channels:
                        self.cycle.wake(lanes[c] for c in channels if c in lanes)
            except Exception as exc:
                log.debug("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                listener.close()
