"""The dashboard's reads on PostgreSQL: timestamps subtracted as an interval's epoch."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from outbox_core.dialects.base.console import ConsoleReads


class PostgresqlConsole(ConsoleReads):
    """``EXTRACT(EPOCH FROM end - start)`` in microseconds."""

    def microseconds_between(
        self, start: sa.ColumnElement[datetime], end: sa.ColumnElement[datetime]
    ) -> sa.ColumnElement[int]:
        """``CAST(EXTRACT(EPOCH FROM end - start) * 1000000 AS BIGINT)``."""
        return sa.cast(sa.extract("epoch", end - start) * 1_000_000, sa.BigInteger())
