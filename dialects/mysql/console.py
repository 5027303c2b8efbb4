"""The dashboard's reads on MySQL and MariaDB: ``TIMESTAMPDIFF`` in microseconds."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from outbox_core.dialects.base.console import ConsoleReads


class MysqlConsole(ConsoleReads):
    """``TIMESTAMPDIFF(MICROSECOND, start, end)``: exact on ``DATETIME(6)``."""

    def microseconds_between(
        self, start: sa.ColumnElement[datetime], end: sa.ColumnElement[datetime]
    ) -> sa.ColumnElement[int]:
        """``TIMESTAMPDIFF(MICROSECOND, start, end)``."""
        return sa.func.timestampdiff(
            sa.literal_column("MICROSECOND"), start, end, type_=sa.BigInteger()
        )
