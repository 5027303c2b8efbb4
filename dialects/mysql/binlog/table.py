"""The outbox table for log tailing on MySQL/MariaDB: its upserts, install and status.

The statements are the relay's own (:class:`~outbox_core.relay.tailing.LogTable`,
plain SQLAlchemy Core); this module spells the upserts (``INSERT ... ON
DUPLICATE KEY UPDATE``), makes ``<table>_wal`` and the deferred rows' index,
and reads the source's status (the named lock of its reader).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.errors import UnsupportedDatabase
from outbox_core.relay.tailing import LogTable, SourceFacts, TailingStatus, source_status

#: The session variable carrying an upsert's condition, evaluated once per row.
_OK = "@outbox_upsert_ok"


class MysqlWrites:
    """:class:`~outbox_core.relay.tailing.TableWrites` on MySQL and MariaDB."""

    def upsert_by_event_id(
        self, table: sa.Table, *, update: Sequence[str], where: sa.ColumnElement[bool]
    ) -> sa.Executable:
        """``INSERT ... ON DUPLICATE KEY UPDATE``, each of ``update`` set only where ``where``
        held of the existing row.

        Assignments run left to right and see the ones before: ``where`` is
        evaluated once, by the first (which changes nothing), into a session
        variable the others read.
        """
        stmt = mysql.insert(table)
        condition = where.compile(dialect=mysql.dialect(), compile_kwargs={"literal_binds": True})
        event_id = table.c.event_id
        first = sa.func.IF(sa.literal_column(f"({_OK} := ({condition}))"), event_id, event_id)
        ok: sa.ColumnElement[Any] = sa.literal_column(_OK)
        sets: list[tuple[Any, Any]] = [(event_id.name, first)]
        sets += [(name, sa.func.IF(ok, stmt.inserted[name], table.c[name])) for name in update]
        return stmt.on_duplicate_key_update(sets)

    def upsert(self, table: sa.Table, key: str, values: Mapping[str, Any]) -> sa.Executable:
        """``INSERT ... ON DUPLICATE KEY UPDATE`` to the same values."""
        stmt = mysql.insert(table).values(**values)
        return stmt.on_duplicate_key_update(
            {name: stmt.inserted[name] for name in values if name != key}
        )

    def commit_lazily(self, conn: sa.Connection) -> None:
        """Nothing: InnoDB's flush at commit is the server's setting, not a session's."""


def deferred_index(outbox: sa.Table) -> sa.Index:
    """``(lease_owner, lease_until, id)``: the rows handed to the table, in hand-over order
    (no partial indexes here; made by ``install --source binlog`` on a copy of the table)."""
    copy = sa.Table(
        outbox.name,
        sa.MetaData(),
        sa.Column(outbox.c.id.name, sa.BigInteger(), key="id"),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_until", sa.DateTime()),
        schema=outbox.schema,
    )
    c = copy.c
    return sa.Index(f"ix_{outbox.name}_wal_deferred", c.lease_owner, c.lease_until, c.id)


class BinlogTable(LogTable):
    """The outbox table's statements for log tailing (MySQL and MariaDB only)."""

    def __init__(self, dialect: Dialect) -> None:
        if dialect.name != "mysql":
            raise UnsupportedDatabase(
                f"--source binlog reads MySQL/MariaDB's binlog, not {dialect.family}: "
                "use --source table"
            )
        super().__init__(dialect, MysqlWrites())
        self.deferred_index = deferred_index(self.table)

    def install(self, conn: Connection) -> None:
        """Create ``<table>_wal`` (and its newer columns) and the deferred rows' index."""
        progress = self.progress
        with self.dialect.transaction(conn):
            progress.table.create(conn, checkfirst=True)
        for column in progress.absent(conn):
            kind = column.type.compile(dialect=conn.dialect)
            name = conn.dialect.identifier_preparer.format_table(progress.table)
            conn.execute(sa.text(f"ALTER TABLE {name} ADD COLUMN {column.name} {kind}"))
        progress.reread()
        if self.deferred_index.name not in self._indexes(conn):
            self.deferred_index.create(conn)
        conn.commit()

    def _indexes(self, conn: Connection) -> set[str]:
        found = sa.inspect(conn).get_indexes(self.table.name, self.table.schema)
        return {str(ix["name"]) for ix in found}

    def missing(self, conn: Connection) -> list[str]:
        """What ``install --source binlog`` makes and the table lacks."""
        progress = self.progress
        gone = [] if progress.exists(conn) else [progress.table.name]
        if self.deferred_index.name not in self._indexes(conn):
            gone.append(str(self.deferred_index.name))
        return gone

    def uninstall(self, conn: Connection) -> None:
        """Drop ``<table>_wal`` and the index if they exist."""
        with self.dialect.transaction(conn):
            self.progress.table.drop(conn, checkfirst=True)
        if self.deferred_index.name in self._indexes(conn):
            self.deferred_index.drop(conn)
        conn.commit()

    def source_status(
        self,
        conn: Connection,
        name: str,
        facts: SourceFacts | None,
        describe: Callable[[int], str],
    ) -> TailingStatus:
        """The source, its relay's last report and the oldest unpublished event's age."""
        return source_status(conn, self, name, facts, describe)
