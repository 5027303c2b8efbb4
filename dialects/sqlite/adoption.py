"""Adopting a team's table on SQLite, whose ``ALTER TABLE ADD`` takes constant defaults only."""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.adoption import Adoption

#: An added ``available_at``: long due (SQLite cannot default an added column to now).
EPOCH = "'1970-01-01 00:00:00.000000'"


class SqliteAdoption(Adoption):
    """No added auto-numbered column nor clock default: the table brings its own."""

    now_default: ClassVar[str | None] = None
    id_definition: ClassVar[str | None] = None
    id_refusal: ClassVar[str] = (
        "SQLite cannot add one to a table; map id= to the table's INTEGER PRIMARY KEY"
    )

    def definition(self, conn: Connection, column: sa.Column[Any]) -> str:
        """``available_at`` defaults to 1970: a row the team writes is due at once."""
        if column.name == "available_at":
            return f"{column.type.compile(dialect=conn.dialect)} NOT NULL DEFAULT {EPOCH}"
        return super().definition(conn, column)
