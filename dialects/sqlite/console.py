"""The dashboard's reads on SQLite: timestamps (ISO text) subtracted as Julian days."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from outbox_core.dialects.base.console import ConsoleReads

#: Microseconds in a day.
DAY = 86_400_000_000


class SqliteConsole(ConsoleReads):
    """``julianday(end) - julianday(start)`` in microseconds.

    SQLite's date functions read the first three digits of the fractional
    seconds: rows fall into buckets to the millisecond.
    """

    def microseconds_between(
        self, start: sa.ColumnElement[datetime], end: sa.ColumnElement[datetime]
    ) -> sa.ColumnElement[int]:
        """``CAST(ROUND((julianday(end) - julianday(start)) * 86400000000) AS INTEGER)``."""
        days = sa.func.julianday(end, type_=sa.Float()) - sa.func.julianday(start, type_=sa.Float())
        return sa.cast(sa.func.round(days * DAY), sa.Integer())
