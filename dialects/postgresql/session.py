"""PostgreSQL relay connections: the connect timeout, server-side limits, how they plan."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import SessionLimits, SessionSetup


class PostgresqlSession(SessionSetup):
    """The server-side limits and planner settings of each relay connection."""

    #: Every relay statement planned for its own parameters. psycopg prepares a
    #: statement once a connection has run it five times, and PostgreSQL's
    #: ``auto`` mode soon keeps one generic plan for it, chosen from default
    #: estimates: the pending window of an ordered claim (``id > :after ...
    #: ORDER BY id LIMIT :n``) can then walk the primary key through every sent
    #: row instead of the pending index, where the statistics still describe a
    #: table that was mostly pending.
    PLAN_CACHE_MODE = "force_custom_plan"
    #: No JIT compilation: a relay's statements are short and run thousands of
    #: times; a plan whose estimate passes ``jit_above_cost`` (stale statistics,
    #: a big table) would pay for compiling it on every claim.
    JIT = "off"

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"connect_timeout": max(1, int(seconds))}

    def configure(self, conn: Connection, limits: SessionLimits) -> None:
        """The limits and planner settings of a relay connection.

        The first makes the server end a session left idle inside a
        transaction (a relay frozen mid-claim or mid-settle), rolling it back
        and releasing its row locks; the second bounds any lock wait; the
        others plan each statement for its parameters (:attr:`PLAN_CACHE_MODE`)
        and never JIT-compile it (:attr:`JIT`).
        All are session settings (``set_config(..., false)``), so they last as
        long as the connection and touch nothing else.
        """
        settings = {
            "idle_in_transaction_session_timeout": f"{round(limits.idle_in_transaction * 1000)}ms",
            "lock_timeout": f"{round(limits.lock_wait * 1000)}ms",
            "plan_cache_mode": self.PLAN_CACHE_MODE,
            "jit": self.JIT,
        }
        with conn.begin():
            for name, value in settings.items():
                conn.execute(sa.select(sa.func.set_config(name, value, False)))

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
