"""MySQL / MariaDB relay connections: READ COMMITTED, lock-wait and idle limits."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import SessionLimits, SessionSetup


def is_mariadb(conn: Connection) -> bool:
    """True on MariaDB (the server identifies itself at connect)."""
    return bool(getattr(conn.dialect, "is_mariadb", False))


class MysqlSession(SessionSetup):
    """Claims and settles at READ COMMITTED; server-side limits that differ by server."""

    isolation_level: ClassVar[str] = "READ COMMITTED"
    #: Set by :meth:`configure` on MySQL, whose ``wait_timeout`` also ends a
    #: relay's idle (not only idle-in-transaction) sessions.
    ends_idle_sessions: bool = False

    def prepare(self, conn: Connection) -> None:
        """Claims and settles run at READ COMMITTED."""
        if conn.get_execution_options().get("isolation_level") != self.isolation_level:
            dbapi_error = conn.dialect.loaded_dbapi.Error
            try:
                conn.execution_options(isolation_level=self.isolation_level)
            except dbapi_error as exc:
                # SQLAlchemy lets the driver's error through here (its COMMIT and SET
                # run outside the statement wrapper): raise it as a statement's is, so
                # a connection the server dropped is an outage, not a crash.
                conn.invalidate(exc)
                raise sa.exc.DBAPIError.instance(
                    "SET SESSION TRANSACTION ISOLATION LEVEL",
                    None,
                    exc,
                    dbapi_error,
                    connection_invalidated=True,
                ) from exc

    def configure(self, conn: Connection, limits: SessionLimits) -> None:
        """``innodb_lock_wait_timeout``, and MariaDB's ``idle_transaction_timeout``.

        MariaDB ends a session idle inside a transaction after
        ``idle_transaction_timeout`` seconds (rolling it back). MySQL has no
        such setting: ``wait_timeout`` ends any idle session, so a frozen
        relay's transaction goes after that long, and :meth:`idle_limit`
        makes the relay replace its own idle connections first. Both take
        whole seconds (at least 1).
        """
        mariadb = is_mariadb(conn)
        self.ends_idle_sessions = not mariadb
        with conn.begin():
            idle = "idle_transaction_timeout" if mariadb else "wait_timeout"
            settings = {
                "innodb_lock_wait_timeout": max(1, math.ceil(limits.lock_wait)),
                idle: max(1, math.ceil(limits.idle_in_transaction)),
            }
            for name, value in settings.items():
                # A session variable's name cannot be a bound parameter; these are constants.
                conn.execute(sa.text(f"SET SESSION {name} = :value"), {"value": value})

    def idle_limit(self, limits: SessionLimits) -> float | None:
        """On MySQL the ``wait_timeout`` set by :meth:`configure`, less a margin."""
        if not self.ends_idle_sessions:
            return None
        return max(0.5, math.ceil(limits.idle_in_transaction) - 0.5)

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"connect_timeout": max(1, int(seconds))}

    #: Server and client error codes of the moment: too many connections,
    #: shutdown in progress, network read/write errors, lock wait timeout,
    #: query interrupted, deadlock, read-only (a failover), connection killed,
    #: cannot connect, server gone away, lost connection, idle disconnect.
    TRANSIENT_CODES = frozenset(
        {1040, 1053, 1158, 1159, 1160, 1161, 1205, 1213, 1290, 1317, 1927, 2002, 2003, 2006,
         2013, 2055, 4031}
    )  # fmt: skip

    def transient(self, error: BaseException) -> bool:
        """By error code (PyMySQL and mysqlclient put it first in ``args``): both file
        nearly every server error, a misspelt column included, as ``OperationalError``."""
        orig = getattr(error, "orig", error)
        args = getattr(orig, "args", ())
        if args and isinstance(args[0], int):
            return args[0] in self.TRANSIENT_CODES
        return isinstance(error, sa.exc.InterfaceError)
