"""The relay's database connections: one per thread, replaced when dead or idle too long.

Every statement of the relay goes through :meth:`Connections.call` (or
:meth:`Connections.call_until`), so what happens after a failed statement is
decided in one place: this thread's connection is dropped and the next use
opens a fresh one; a lost or refused connection marks the database down (one
log line, ``/healthz``) until a statement succeeds again; and a statement
that must not be lost, settling a published batch, is retried on a fresh
connection, past its lease if need be, for at most as long as leases are
renewed (docs/design.md, Liveness: a database restart).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.errors import DatabaseError, translate_errors
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.state import DatabaseState
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: First and longest wait between tries while the database cannot be reached:
#: short, so the relay resumes within a second or two of the database's return.
RETRY_FIRST = 0.1
RETRY_MAX = 2.0
#: Longest wait between tries of a settle: the batch is published, and its
#: owner should mark it before any relay reaps its lease (:data:`REAP_GRACE`).
SETTLE_RETRY_MAX = 0.5
#: After the database was unreachable, a relay reaps expired leases only once
#: it has reached it again for this long: leases that ran out during the
#: outage belong to relays whose settles are retrying (every
#: :data:`SETTLE_RETRY_MAX`), and reaping them first would publish those
#: events twice.
REAP_GRACE = 2.0
#: A settle in flight when the relay is asked to stop keeps retrying this long.
STOP_GRACE = 5.0
#: While the database stays unreachable, a reminder is logged this often.
REMIND_EVERY = 60.0

P = ParamSpec("P")
T = TypeVar("T")


class Connections:
    """Per-thread connections of one relay, each carrying the session limits.

    ``run()``'s claim, settle and maintenance threads work in parallel, each
    on its own connection; ``run_once()`` uses the caller's thread's.
    """

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        limits: SessionLimits,
        *,
        ordered: bool,
        stop: threading.Event | None = None,
        observers: Sequence[RelayObserver] = (),
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.limits = limits
        #: Set when the relay stops: retries give up at once.
        self.stop = stop or threading.Event()
        self.observers = observers
        #: Could the database be reached at the last try? (Changed under ``_lock``.)
        self.state = DatabaseState()
        # time.monotonic() when the last outage began and ended: connections
        # opened before it began are dead (the server restarted), and reaping
        # waits REAP_GRACE after it ended.
        self._down_at = float("-inf")
        self._back_at = float("-inf")
        self._reminded_at = float("-inf")
        #: Ordered relays check the database can serve ordered claims (Dialect.check_ordered)
        #: before their first claim: at start, or on their first connection if it was down.
        self.ordered_checked = not ordered
        self._local = threading.local()
        self._open: list[Connection] = []
        self._lock = threading.Lock()
        self._idle_limit: float | None = None

    def get(self) -> Connection:
        """This thread's connection, opened on first use and after a failure."""
        local = self._local
        conn: Connection | None = getattr(local, "conn", None)
        now = time.monotonic()
        idle = now - getattr(local, "used_at", now)
        stale = self._idle_limit is not None and idle > self._idle_limit
        # Opened before the last outage began: that server is gone, whatever
        # the connection object believes (SQLAlchemy only learns on next use).
        stale = stale or getattr(local, "opened_at", now) < self._down_at
        if conn is None or conn.closed or conn.invalidated or stale:
            self.drop(broken=True)
            conn = self._open_one()
            local.conn = conn
            local.opened_at = time.monotonic()
        local.used_at = now
        return conn

    def may_reap(self) -> bool:
        """The database answers, and not just since :data:`REAP_GRACE` (see there)."""
        return self.state.up and time.monotonic() - self._back_at >= REAP_GRACE

    def _open_one(self) -> Connection:
        try:
            with translate_errors("connect"):
                conn = self.engine.connect()
        except DatabaseError as exc:
            exc.unreachable = exc.transient = True  # no connection could be made
            raise
        with translate_errors("connect"):
            try:
                with self.dialect.transaction(conn):
                    self.dialect.storage.initialize(conn)
                self.dialect.session.configure(conn, self.limits)
                if not self.ordered_checked:
                    self.dialect.check_ordered(conn)  # UnsupportedDatabase ends run()
                    self.ordered_checked = True
            except BaseException:
                self._close(conn, broken=True)  # not back to the pool: its reset would fail
                raise
        self._idle_limit = self.dialect.session.idle_limit(self.limits)
        with self._lock:
            self._open.append(conn)
        return conn

    def call(
        self,
        what: str,
        statement: Callable[Concatenate[Connection, P], T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Run ``statement(conn, ...)`` on this thread's connection.

        Driver errors become :class:`DatabaseError` naming ``what``; after
        one, the connection is dropped (the next call reconnects).
        """
        try:
            with translate_errors(what):
                result = statement(self.get(), *args, **kwargs)
        except DatabaseError as exc:
            self.drop(broken=True)
            cause = exc.__cause__
            if not exc.transient and cause is not None:
                exc.transient = self.dialect.session.transient(cause)
            if exc.unreachable:
                self._lost(exc)
            raise
        if not self.state.up:
            self._came_back()
        return result

    def _lost(self, exc: DatabaseError) -> None:
        """A connection broke: the database is down, unless a fresh one answers at once.

        One session ended on its own (killed by an operator, cut by a proxy
        when idle) is not an outage: no 503, no pause in reaping.
        """
        if self.state.up:
            try:
                with translate_errors("reconnect"):
                    self.get()
            except DatabaseError:
                pass
            else:
                log.warning("%s; reconnected (the database answers)", exc)
                return
        self._went_down(exc)

    def log_failure(self, exc: DatabaseError, doing: str, wait: float) -> None:
        """Log a failed statement of a loop that retries in ``wait`` seconds.

        An unreachable database was logged once when it went; while it stays
        down, a reminder every :data:`REMIND_EVERY` seconds. Anything else is
        an error of its own, logged each time.
        """
        if not exc.unreachable:
            log.error("%s%s; retrying in %.1fs", doing, exc, wait)
            return
        if self.state.up:  # one session lost, a fresh one answered (_lost said so)
            log.debug("%s%s; retrying in %.2fs", doing, exc, wait)
            return
        now = time.monotonic()
        with self._lock:
            remind = now - max(self._down_at, self._reminded_at) >= REMIND_EVERY
            if remind:
                self._reminded_at = now
        if remind:
            log.warning(
                "database still unavailable (%.0fs): %s", time.time() - self.state.since, exc
            )
        else:
            log.debug("%s%s; retrying in %.2fs", doing, exc, wait)

    def call_until(
        self,
        until: float,
        what: str,
        statement: Callable[Concatenate[Connection, P], T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Like :meth:`call`, retried on a fresh connection until ``time.monotonic()`` is ``until``.

        Only for a statement that is safe to run again: settling, fenced by
        its token (a retry after the lease ended changes nothing). Transient
        failures (a lost connection, a server restarting, a lock wait cut
        short) are retried with a jittered backoff of at most
        :data:`SETTLE_RETRY_MAX`; any other failure, the deadline or the
        relay stopping raises the last error (after :data:`STOP_GRACE`:
        the batch in flight is settled if it can be).
        """
        waits = Backoff(RETRY_FIRST, SETTLE_RETRY_MAX, jitter=0.2)
        stop_by: float | None = None
        while True:
            try:
                return self.call(what, statement, *args, **kwargs)
            except DatabaseError as exc:
                wait = waits.next()
                if self.stop.is_set():
                    stop_by = stop_by or time.monotonic() + STOP_GRACE
                    until = min(until, stop_by)
                if not exc.transient or time.monotonic() + wait >= until:
                    raise
                level = logging.DEBUG if exc.unreachable else logging.WARNING
                log.log(level, "%s; retrying in %.2fs on a fresh connection", exc, wait)
                if stop_by is None:
                    self.stop.wait(wait)
                else:
                    time.sleep(wait)

    def _went_down(self, exc: DatabaseError) -> None:
        with self._lock:
            # Connections opened before this are suspect, even in an outage
            # already known (the server came back briefly, then went again).
            self._down_at = time.monotonic()
            if not self.state.up:
                return
            self.state = state = DatabaseState(up=False, error=str(exc))
        log.error(
            "database unavailable: %s; retrying every %.0fs at most, the settles of "
            "published batches until it answers",
            exc,
            RETRY_MAX,
        )
        for observer in self.observers:
            observer.database_changed(state)

    def _came_back(self) -> None:
        with self._lock:
            if self.state.up:
                return
            previous = self.state
            self.state = state = DatabaseState(up=True)
            self._back_at = time.monotonic()
        log.info("database answers again after %.1fs", state.since - previous.since)
        for observer in self.observers:
            observer.database_changed(state)

    def drop(self, *, broken: bool = False) -> None:
        """Close this thread's connection (the next use reconnects).

        ``broken``: after a failure, or the server restarted since it was
        opened. It is discarded, not returned to the pool: the pool's reset
        (a ROLLBACK) on a dead connection fails and logs a traceback.
        """
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            self._close(conn, broken=broken)

    def _close(self, conn: Connection, *, broken: bool = False) -> None:
        with self._lock:
            if conn in self._open:
                self._open.remove(conn)
        try:
            if broken and not conn.closed:
                conn.invalidate()
            conn.close()
        except sa.exc.SQLAlchemyError:
            log.debug("closing a broken connection failed", exc_info=True)

    def close_all(self) -> None:
        """Close every thread's connection.

        While the database is down they are discarded, not returned to the
        pool, whose reset (a ROLLBACK) on a dead connection logs a traceback.
        """
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            self._close(conn, broken=not self.state.up)
        self._local = threading.local()
