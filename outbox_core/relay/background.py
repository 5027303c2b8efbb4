"""The side threads of ``Relay.run()``: maintenance (leases, reap, cleanup) and LISTEN wake-ups.

Maintenance is off the settle path (docs/design.md, Liveness): it runs on a
thread and connection of its own, so a slow or blocked maintenance statement
never holds up claiming or settling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult
from outbox_core.relay.connections import RETRY_MAX
from outbox_core.retry import Backoff

if TYPE_CHECKING:
    from outbox_core.relay.facade import Relay

log = logging.getLogger("outbox.relay")

#: Longest wait after maintenance or LISTEN failed again and again for a
#: reason of their own; a transient failure (the database restarting) waits
#: at most :data:`~outbox_core.relay.connections.RETRY_MAX`.
ERROR_MAX = 30.0
#: First wait before opening LISTEN again.
LISTEN_FIRST = 0.5
#: Failures in a row of opening LISTEN, the database answering, before they are logged.
LISTEN_QUIET_FAILURES = 3


@dataclass
class Due:
    """A periodic task's schedule (monotonic clock); an interval of 0 never runs it."""

    interval: float
    next_at: float = 0.0

    def ready(self, now: float) -> bool:
        """True (and the next run scheduled) when the task is due at ``now``."""
        if self.interval <= 0 or now < self.next_at:
            return False
        self.next_at = now + self.interval
        return True


def maintain(relay: Relay) -> None:
    """Renew leases in flight, reap and clean up when due, until the relay stops.

    Errors are logged and retried with backoff.
    """
    tick = min(max(relay.settings.lease / 10, 0.05), 1.0)
    errors = Backoff(2 * tick, ERROR_MAX, jitter=0.2)
    outage = Backoff(min(2 * tick, RETRY_MAX), RETRY_MAX, jitter=0.2)
    wait = tick
    while not relay._stop.wait(wait):
        try:
            relay.keep_leases()
            reaped = relay.reap() if relay._reap.ready(time.monotonic()) else 0
            cleaned = relay.cleanup() if relay._cleanup.ready(time.monotonic()) else 0
            if reaped or cleaned:
                relay._finish(CycleResult(reaped=reaped, cleaned=cleaned))
            wait = tick
            errors.reset()
            outage.reset()
        except DatabaseError as exc:
            wait = (outage if exc.transient else errors).next()
            relay.connections.log_failure(exc, "maintenance: ", wait)
        except Exception:
            wait = errors.next()
            log.exception("maintenance failed")


def listen(relay: Relay) -> None:
    """Wake the relay on the database's notifications (PostgreSQL LISTEN).

    Losing LISTEN only slows wake-ups to polling, and a database restart
    ends it along with every other connection (logged once, by the
    connections): it is logged only when it keeps failing while the
    database answers.
    """
    # LISTEN is only a wake-up (claims poll meanwhile): retry as often as
    # claims do, so wake-ups resume as soon as the database is back.
    waits = Backoff(LISTEN_FIRST, RETRY_MAX, jitter=0.2)
    stop = relay._stop
    while not stop.is_set():
        try:
            listener = relay.dialect.enqueue.listener(relay.engine)
        except Exception as exc:
            wait = waits.next()
            own_problem = relay.database_state.up and waits.failures >= LISTEN_QUIET_FAILURES
            level = logging.WARNING if own_problem else logging.DEBUG
            log.log(level, "LISTEN failed (%s); polling, retrying in %.1fs", exc, wait)
            stop.wait(wait)
            continue
        if listener is None:
            return  # this database has no notifications: polling only
        waits.reset()
        try:
            while not stop.is_set():
                if listener.wait(0.5):
                    relay.wake()
        except Exception as exc:
            log.debug("LISTEN connection lost (%s); reconnecting", exc)
        finally:
            listener.close()


def heartbeats(relay: Relay) -> None:
    """Partitioned ordering: heartbeat and rebalance on a thread and connection of their own.

    Apart from claims and maintenance, so a slow claim or reap never makes
    this relay look stale to the others.
    """
    membership = relay.membership
    assert membership is not None
    errors = Backoff(membership.heartbeat / 2, membership.heartbeat, jitter=0.2)
    wait = 0.0
    while not relay._stop.wait(wait):
        try:
            membership.tick()
            wait = membership.heartbeat / 4
            errors.reset()
        except DatabaseError as exc:
            wait = errors.next()
            relay.connections.log_failure(exc, "membership: ", wait)
        except Exception:
            wait = errors.next()
            log.exception("membership failed")
