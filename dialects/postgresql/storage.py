"""What PostgreSQL cannot store (NUL in text and jsonb), and how its columns bind and read."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa

from outbox_core.dialects.base import StorageRules


class PostgresqlStorage(StorageRules):
    """PostgreSQL's storage rules: jsonb is parsed by the server, NUL is refused."""

    #: jsonb is parsed by the server (it refuses NUL in strings).
    parses_json: ClassVar[bool] = True
    json_as_text: ClassVar[bool] = True

    def text_problem(self, name: str, value: str) -> str | None:
        """Also refused: NUL (``\\u0000``), which neither text nor jsonb can hold."""
        if "\x00" in value:
            return f"{name} contains a NUL character (\\u0000), which PostgreSQL cannot store"
        return super().text_problem(name, value)

    def bind_time(self, value: datetime | None) -> datetime | None:
        """Aware UTC: a naive value bound to TIMESTAMPTZ is read in the session's time zone."""
        return None if value is None else value.replace(tzinfo=UTC)

    def json_text(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
        """``CAST(payload AS TEXT)``: psycopg would decode jsonb itself."""
        return sa.cast(column, sa.Text)

    def json_suspect(self, text: str) -> bool:
        """JSON text writes NUL as ``\\u0000``."""
        return "\\u0000" in text
