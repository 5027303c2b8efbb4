"""PostgreSQL relay connections: the driver's connect timeout and the server-side limits."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import SessionLimits, SessionSetup


class PostgresqlSession(SessionSetup):
    """``idle_in_transaction_session_timeout`` and ``lock_timeout`` on each relay connection."""

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"connect_timeout": max(1, int(seconds))}

    def configure(self, conn: Connection, limits: SessionLimits) -> None:
        """``idle_in_transaction_session_timeout`` and ``lock_timeout`` on a relay connection.

        The first makes the server end a session left idle inside a
        transaction (a relay frozen mid-claim or mid-settle), rolling it back
        and releasing its row locks; the second bounds any lock wait. Both are
        session settings (``set_config(..., false)``), so they last as long as
        the connection and touch nothing else.
        """
        settings = {
            "idle_in_transaction_session_timeout": limits.idle_in_transaction,
            "lock_timeout": limits.lock_wait,
        }
        with conn.begin():
            for name, seconds in settings.items():
                conn.execute(
                    sa.select(sa.func.set_config(name, f"{round(seconds * 1000)}ms", False))
                )

    #: SQLSTATEs of the moment: connection exceptions (08), insufficient
    #: resources (53), serialization failure, deadlock, lock not available,
    #: statement cancelled, the server shutting down or starting up (57P0x).
    TRANSIENT_STATES = frozenset({"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03"})

    def transient(self, error: BaseException) -> bool:
        """By SQLSTATE (psycopg's ``sqlstate``, psycopg2's ``pgcode``)."""
        orig = getattr(error, "orig", error)
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if state is None:  # no answer from a server: a connection that failed
            return isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError)
        return state[:2] in ("08", "53") or state in self.TRANSIENT_STATES
