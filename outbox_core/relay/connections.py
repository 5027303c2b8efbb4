"""The relay's database connections: one per thread, replaced when dead or idle too long.

Every statement of the relay goes through :meth:`Connections.call`, so what
happens after a failed statement (today: this thread's connection is dropped
and the next use opens a fresh one) is decided in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.errors import DatabaseError, translate_errors

log = logging.getLogger("outbox.relay")

P = ParamSpec("P")
T = TypeVar("T")


class Connections:
    """Per-thread connections of one relay, each carrying the session limits.

    ``run()``'s claim, settle and maintenance threads work in parallel, each
    on its own connection; ``run_once()`` uses the caller's thread's.
    """

    def __init__(
        self, engine: Engine, dialect: Dialect, limits: SessionLimits, *, ordered: bool
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.limits = limits
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
        if conn is None or conn.closed or conn.invalidated or stale:
            self.drop()
            conn = self._open_one()
            local.conn = conn
        local.used_at = now
        return conn

    def _open_one(self) -> Connection:
        with translate_errors("connect"):
            conn = self.engine.connect()
            try:
                with self.dialect.transaction(conn):
                    self.dialect.storage.initialize(conn)
                self.dialect.session.configure(conn, self.limits)
                if not self.ordered_checked:
                    self.dialect.check_ordered(conn)  # UnsupportedDatabase ends run()
                    self.ordered_checked = True
            except BaseException:
                conn.close()
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
                return statement(self.get(), *args, **kwargs)
        except DatabaseError:
            self.drop()
            raise

    def drop(self) -> None:
        """Close this thread's connection (after a failure: the next use reconnects)."""
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._open:
                self._open.remove(conn)
        try:
            conn.close()
        except sa.exc.SQLAlchemyError:
            log.debug("closing a broken connection failed", exc_info=True)

    def close_all(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            self._close(conn)
        self._local = threading.local()
