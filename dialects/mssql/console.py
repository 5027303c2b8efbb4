"""The dashboard's reads on SQL Server: ``DATEDIFF_BIG`` in microseconds."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from outbox_core.dialects.base.console import ConsoleReads


class MssqlConsole(ConsoleReads):
    """``DATEDIFF_BIG(microsecond, start, end)`` (SQL Server 2016): ``DATEDIFF`` returns an
    int, which overflows past about 35 minutes of microseconds."""

    def microseconds_between(
        self, start: sa.ColumnElement[datetime], end: sa.ColumnElement[datetime]
    ) -> sa.ColumnElement[int]:
        """``DATEDIFF_BIG(microsecond, start, end)``."""
        return sa.func.datediff_big(
            sa.literal_column("microsecond"), start, end, type_=sa.BigInteger()
        )
