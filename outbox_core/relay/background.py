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
from outbox_core.retry import Backoff

if TYPE_CHECKING:
    from outbox_core.relay.facade import Relay

log = logging.getLogger("outbox.relay")

#: Longest wait after maintenance or LISTEN failed again and again.
RETRY_MAX = 30.0
#: First wait before opening LISTEN again.
LISTEN_FIRST = 0.5


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
    errors = Backoff(2 * tick, RETRY_MAX, jitter=0.2)
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
        except DatabaseError as exc:
            wait = errors.next()
            log.error("maintenance: %s; retrying in %.1fs", exc, wait)
        except Exception:
            wait = errors.next()
            log.exception("maintenance failed")


def listen(relay: Relay) -> None:
    """Wake the relay on the database's notifications (PostgreSQL LISTEN)."""
    waits = Backoff(LISTEN_FIRST, RETRY_MAX, jitter=0.2)
    stop = relay._stop
    while not stop.is_set():
        try:
            listener = relay.dialect.enqueue.listener(relay.engine)
        except Exception as exc:
            wait = waits.next()
            log.warning("LISTEN failed (%s); polling, retrying in %.1fs", exc, wait)
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
            log.warning("LISTEN connection lost (%s); reconnecting", exc)
        finally:
            listener.close()
