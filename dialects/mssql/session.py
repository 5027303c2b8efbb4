"""SQL Server relay connections: ``SET LOCK_TIMEOUT`` and the filtered indexes' SET options."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import SessionLimits, SessionSetup

#: The SET options a connection needs to write a table with filtered indexes.
FILTERED_INDEX_OPTIONS = (
    "SET ANSI_NULLS, ANSI_PADDING, ANSI_WARNINGS, ARITHABORT, CONCAT_NULL_YIELDS_NULL, "
    "QUOTED_IDENTIFIER ON; SET NUMERIC_ROUNDABORT OFF"
)


class MssqlSession(SessionSetup):
    """The session settings of each relay connection."""

    def configure(self, conn: Connection, limits: SessionLimits) -> None:
        """``SET LOCK_TIMEOUT`` (milliseconds) and the filtered indexes' SET options.

        SQL Server has no idle-in-transaction timeout: a relay frozen inside a
        transaction keeps its locks until its TCP connection dies. Claims and
        maintenance skip those rows (READPAST), so other relays keep moving,
        but the frozen relay's rows wait for it (see the README's reliability
        section).
        """
        with conn.begin():
            # SET LOCK_TIMEOUT takes a constant, not a parameter; this is an int.
            conn.execute(sa.text(f"SET LOCK_TIMEOUT {round(limits.lock_wait * 1000):d}"))
            conn.execute(sa.text(FILTERED_INDEX_OPTIONS))

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"timeout": max(1, int(seconds))}

    #: ODBC SQLSTATEs of the moment: communication link failure, cannot
    #: connect, connection rejected, deadlock victim, timeouts.
    TRANSIENT_STATES = frozenset({"08S01", "08001", "08004", "40001", "HYT00", "HYT01"})

    def transient(self, error: BaseException) -> bool:
        """By the ODBC SQLSTATE pyodbc puts first in ``args``."""
        orig = getattr(error, "orig", error)
        args = getattr(orig, "args", ())
        if args and isinstance(args[0], str) and len(args[0]) == 5:
            return args[0] in self.TRANSIENT_STATES
        return isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError)
