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
            conn.execution_options(isolation_level=self.isolation_level)

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
