"""The side tasks of ``Relay.run()``: maintenance (leases, reap, cleanup), heartbeats, LISTEN.

Maintenance is off the settle path (docs/design.md, Liveness): it runs on a
thread and connection of its own, so a slow or blocked maintenance statement
never holds up claiming or settling.
"""

from __future__ import annotations

import logging

from sqlalchemy.engine import Engine

from outbox_core.dialects.base import Dialect
from outbox_core.errors import DatabaseError
from outbox_core.relay.claims import Membership
from outbox_core.relay.connections import RETRY_MAX, Connections
from outbox_core.relay.control import Control
from outbox_core.relay.cycle import Cycle
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: Longest wait after maintenance or LISTEN failed again and again for a
#: reason of their own; a transient failure (the database restarting) waits
#: at most :data:`~outbox_core.relay.connections.RETRY_MAX`.
ERROR_MAX = 30.0
#: First wait before opening LISTEN again.
LISTEN_FIRST = 0.5
#: Failures in a row of opening LISTEN, the database answering, before they are logged.
LISTEN_QUIET_FAILURES = 3


class Maintenance:
    """Renew leases in flight, reap and clean up when due, until the relay stops.

    Errors are logged and retried with backoff.
    """

    name = "outbox-maintain"
    join_timeout = 30.0

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle
        #: How often leases in flight are looked at: a tenth of a lease, 0.05 to 1 s.
        self.tick = min(max(cycle.settings.lease / 10, 0.05), 1.0)

    def run(self) -> None:
        """Loop until the relay stops."""
        cycle = self.cycle
        errors = Backoff(2 * self.tick, ERROR_MAX, jitter=0.2)
        outage = Backoff(min(2 * self.tick, RETRY_MAX), RETRY_MAX, jitter=0.2)
        wait = self.tick
        while not cycle.control.sleep(wait):
            try:
                cycle.maintain()
                wait = self.tick
                errors.reset()
                outage.reset()
            except DatabaseError as exc:
                wait = (outage if exc.transient else errors).next()
                cycle.connections.log_failure(exc, "maintenance: ", wait)
            except Exception:
                wait = errors.next()
                log.exception("maintenance failed")


class Listener:
    """Wake the relay on the database's notifications (PostgreSQL LISTEN).

    Losing LISTEN only slows wake-ups to polling, and a database restart
    ends it along with every other connection (logged once, by the
    connections): it is logged only when it keeps failing while the
    database answers.
    """

    name = "outbox-listen"
    join_timeout = 5.0

    def __init__(
        self, dialect: Dialect, engine: Engine, control: Control, connections: Connections
    ) -> None:
        self.dialect = dialect
        self.engine = engine
        self.control = control
        self.connections = connections

    def run(self) -> None:
        """Loop until the relay stops (at once where the database has no notifications)."""
        # LISTEN is only a wake-up (claims poll meanwhile): retry as often as
        # claims do, so wake-ups resume as soon as the database is back.
        waits = Backoff(LISTEN_FIRST, RETRY_MAX, jitter=0.2)
        control = self.control
        while not control.stopping:
            try:
                listener = self.dialect.enqueue.listener(self.engine)
            except Exception as exc:
                wait = waits.next()
                own_problem = self.connections.state.up and waits.failures >= LISTEN_QUIET_FAILURES
                level = logging.WARNING if own_problem else logging.DEBUG
                log.log(level, "LISTEN failed (%s); polling, retrying in %.1fs", exc, wait)
                control.sleep(wait)
                continue
            if listener is None:
                return  # this database has no notifications: polling only
            waits.reset()
            try:
                while not control.stopping:
                    if listener.wait(0.5):
                        control.wake()
            except Exception as exc:
                log.debug("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                listener.close()


class Heartbeats:
    """Partitioned ordering: heartbeat and rebalance on a thread and connection of their own.

    Apart from claims and maintenance, so a slow claim or reap never makes
    this relay look stale to the others.
    """

    name = "outbox-members"
    join_timeout = 10.0

    def __init__(self, membership: Membership, control: Control, connections: Connections) -> None:
        self.membership = membership
        self.control = control
        self.connections = connections

    def run(self) -> None:
        """Loop until the relay stops."""
        membership = self.membership
        errors = Backoff(membership.heartbeat / 2, membership.heartbeat, jitter=0.2)
        wait = 0.0
        while not self.control.sleep(wait):
            try:
                membership.tick()
                wait = membership.heartbeat / 4
                errors.reset()
            except DatabaseError as exc:
                wait = errors.next()
                self.connections.log_failure(exc, "membership: ", wait)
            except Exception:
                wait = errors.next()
                log.exception("membership failed")
