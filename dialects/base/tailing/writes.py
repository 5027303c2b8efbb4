"""The writes of log tailing that each database spells its own way: upserts.

Everything else the log-tailing relay writes or reads in the outbox table is
plain SQLAlchemy Core (:mod:`.table`); the database's log-tailing package
gives these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa


class TableWrites(Protocol):
    """Upserts, and a commit that does not wait for the disk."""

    def upsert_by_event_id(
        self, table: sa.Table, *, update: Sequence[str], where: sa.ColumnElement[bool]
    ) -> sa.Executable:
        """An insert of whole rows (run with a list of them) that, for a row whose
        ``event_id`` exists, sets the ``update`` columns to the new row's values where
        ``where`` holds of the existing row, and otherwise leaves it."""

    def upsert(self, table: sa.Table, key: str, values: Mapping[str, Any]) -> sa.Executable:
        """Insert ``values``, or set the row with the same ``key`` column to them."""

    def commit_lazily(self, conn: sa.Connection) -> None:
        """Let the transaction open on ``conn`` commit without waiting for the disk."""
