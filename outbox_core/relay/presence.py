"""Every running relay in the presence table: a row per relay, whatever its mode.

While ``run()`` runs, a relay (polling, in any ordering, or log tailing)
writes its row every ``heartbeat`` seconds: its host and process, its mode,
what it published and made dead since it started and in the last minute
(:class:`PublishCounts`, an observer). On a clean stop it deletes the row; a
killed relay's row ages, and any relay removes rows whose heartbeat is older
than :data:`FORGET_AFTER`. ``Outbox.fleet()``, ``outbox status`` and the
dashboard read the table.

The row is written on a thread and connection of its own, never on the
threads that claim and settle: a slow or failed write only makes the row
older. A table created before this one existed has no presence table: the
relay says once that ``outbox install`` adds it and runs without it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa

from outbox_core.dialects.base.presence import Beat, PresenceStatements
from outbox_core.errors import DatabaseError
from outbox_core.message import Event, Failure, Outcome
from outbox_core.relay.connections import Connections
from outbox_core.relay.control import Control
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.schedule import Every
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: A row whose heartbeat is older than this (seconds) is a relay that died without
#: leaving: any relay removes it.
FORGET_AFTER = 3600.0
#: How often a relay looks for such rows, in seconds.
FORGET_EVERY = 60.0
#: The window of ``published_last_minute``, in one-second slots.
WINDOW = 60
#: Longest wait after writing the row failed again and again.
ERROR_MAX = 30.0


def unique_id(name: str) -> str:
    """A relay's id in the presence and membership tables: its name and a random suffix.

    Unique per relay object, whatever ``--name`` says: two relays sharing a
    row would overwrite each other's.
    """
    return f"{name[:50]}:{uuid.uuid4().hex[:8]}"


class PublishCounts(RelayObserver):
    """Events the broker accepted and events made dead since the start, and the last minute's.

    Told by the settle threads (two at once) and read by the presence
    thread, under a lock; the last minute is a ring of per-second counts.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.published = 0
        self.dead = 0
        self._seconds = [-WINDOW] * WINDOW
        self._counts = [0] * WINDOW
        self._lock = threading.Lock()

    def settled(
        self,
        events: Sequence[Event],
        outcomes: Sequence[Outcome],
        failures: Sequence[Failure],
        *,
        sent: int,
        lost: int,
        seconds: float,
    ) -> None:
        """Count a settled batch: each answer that is not a failure was accepted."""
        # One failure per answer that is not ok: no step per event.
        self.add(len(outcomes) - len(failures), sum(1 for f in failures if f.retry_in is None))

    def add(self, published: int, dead: int = 0) -> None:
        """Count ``published`` accepted events and ``dead`` events made dead, now."""
        second = int(self.clock())
        slot = second % WINDOW
        with self._lock:
            self.published += published
            self.dead += dead
            if self._seconds[slot] != second:
                self._seconds[slot] = second
                self._counts[slot] = 0
            self._counts[slot] += published

    def snapshot(self) -> tuple[int, int, int]:
        """``(published, dead, published in the last minute)``, read together."""
        second = int(self.clock())
        with self._lock:
            recent = sum(
                n for s, n in zip(self._seconds, self._counts, strict=True) if second - s < WINDOW
            )
            return self.published, self.dead, recent


class Presence:
    """This relay's row in the presence table: a side task of ``run()``.

    Writes the row at once and then every ``interval`` seconds, removes
    stale rows every :data:`FORGET_EVERY` seconds, and deletes its own row
    when the relay stops. Database errors are logged and retried with
    backoff; they never reach the relay's loop.
    """

    name = "outbox-presence"
    join_timeout = 5.0

    def __init__(
        self,
        relay_id: str,
        mode: str,
        statements: PresenceStatements,
        connections: Connections,
        control: Control,
        *,
        interval: float,
        dead: Callable[[], int] | None = None,
    ) -> None:
        self.relay_id = relay_id
        self.mode = mode
        self.statements = statements
        self.connections = connections
        self.control = control
        self.interval = interval
        #: What the row reports: add it to the relay's observers.
        self.counts = PublishCounts()
        #: The relay's own count of dead events where the broker did not see them all
        #: (log tailing makes a dead event's later events of its key dead too).
        self.dead = dead
        self.host = socket.gethostname()
        self.pid = os.getpid()
        #: Rows whose heartbeat is older than this many seconds are removed.
        self.forget_after = FORGET_AFTER
        self.forgetting = Every(FORGET_EVERY)
        #: None until the table was looked for; False: it is missing (no row is written).
        self.installed: bool | None = None
        #: This relay's row is in the table (as far as it knows).
        self.written = False

    @property
    def table(self) -> str:
        """The presence table's name, for log lines."""
        return str(self.statements.presence.fullname)

    def beat(self) -> Beat:
        """The row as of now."""
        published, dead, recent = self.counts.snapshot()
        if self.dead is not None:
            dead = self.dead()
        return Beat(self.relay_id, self.host, self.pid, self.mode, published, dead, recent)

    def run(self) -> None:
        """Write the row until the relay stops, then delete it."""
        errors = Backoff(min(self.interval, 1.0), ERROR_MAX, jitter=0.2)
        wait = 0.0
        while not self.control.sleep(wait):
            try:
                if not self.tick():
                    return  # no presence table: the relay runs without a row
                wait = self.interval
                errors.reset()
            except DatabaseError as exc:
                if isinstance(exc.__cause__, sa.exc.ProgrammingError):
                    # The table went, or this role may not write it: not worth a
                    # line every few seconds; the relay's work goes on.
                    log.warning(
                        "relay %s stops writing its row in %s (%s): `outbox install` "
                        "creates the table, its owner grants the rights; relaying goes on",
                        self.relay_id,
                        self.table,
                        exc,
                    )
                    return
                wait = errors.next()
                self.connections.log_failure(exc, "presence: ", wait)
            except Exception:
                wait = errors.next()
                log.exception("writing the relay's presence row failed")
        self.leave()

    def tick(self) -> bool:
        """Look for the table (once), write the row, remove stale rows when due.

        False when the table is missing.
        """
        call = self.connections.call
        if self.installed is None:
            self.installed = call("presence", self.statements.installed)
            if not self.installed:
                log.info(
                    "relay %s is not listed by `outbox status` or the dashboard: this "
                    "database has no %s table, which `outbox install` adds; relaying goes on",
                    self.relay_id,
                    self.table,
                )
        if not self.installed:
            return False
        if call("presence", self.statements.beat, self.beat()) and self.written:
            log.warning(
                "relay %s's row in %s was removed by another relay (its heartbeat was "
                "too old): written again",
                self.relay_id,
                self.table,
            )
        self.written = True
        if self.forgetting.due(time.monotonic()):
            removed = call("presence", self.statements.forget_stale, self.forget_after)
            if removed:
                log.info(
                    "removed %d relays from %s: no heartbeat for %.0fs",
                    removed,
                    self.table,
                    self.forget_after,
                )
        return True

    def leave(self) -> None:
        """Delete this relay's row (a failure leaves it to age until it is removed)."""
        if not self.written:
            return
        try:
            self.connections.call("presence", self.statements.leave, self.relay_id)
        except DatabaseError as exc:
            log.debug("relay %s could not delete its presence row: %s", self.relay_id, exc)
            return
        self.written = False
