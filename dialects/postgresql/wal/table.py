"""The outbox table for log tailing on PostgreSQL: its upserts, install and status.

The statements themselves are the relay's own
(:class:`~outbox_core.relay.tailing.LogTable`, plain SQLAlchemy Core); this
module spells the upserts (``INSERT ... ON CONFLICT``), makes what ``outbox
install --source wal`` adds to the table (``<table>_wal``, and the index of
the events handed to the table) and reads the slot's status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.sql.visitors import ExternallyTraversible, replacement_traverse

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.tailing.deferred_rows import DEFERRED, WHOLE_ROW
from outbox_core.dialects.postgresql.wal.names import format_lsn
from outbox_core.dialects.postgresql.wal.slots import slot_facts
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import State
from outbox_core.relay.tailing import LogTable, SourceFacts, TailingStatus, source_status
from outbox_core.schema import in_state


class PostgresWrites:
    """:class:`~outbox_core.relay.tailing.TableWrites` on PostgreSQL.

    ``adopted``: the outbox table is a team's own (``--columns``), which may
    have columns of its own the toolkit has no value for (Debezium's
    ``aggregate_type NOT NULL``).
    """

    def __init__(self, *, adopted: bool = False) -> None:
        self.adopted = adopted

    def upsert_by_event_id(
        self, table: sa.Table, *, update: Sequence[str], where: sa.ColumnElement[bool]
    ) -> sa.Executable:
        """``INSERT ... ON CONFLICT (event_id) DO UPDATE SET <update> = EXCLUDED ... WHERE``.

        On an adopted table, an update of the row and an insert only where it
        is missing (:func:`update_or_insert`).
        """
        if self.adopted:
            return update_or_insert(table, update=update, where=where)
        stmt = postgresql.insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.event_id],
            set_={name: stmt.excluded[name] for name in update},
            where=where,
        )

    def upsert(self, table: sa.Table, key: str, values: Mapping[str, Any]) -> sa.Executable:
        """``INSERT ... ON CONFLICT (key) DO UPDATE`` to the same values."""
        changed = {name: value for name, value in values.items() if name != key}
        stmt = postgresql.insert(table).values(**values)
        return stmt.on_conflict_do_update(index_elements=[table.c[key]], set_=changed)

    def commit_lazily(self, conn: sa.Connection) -> None:
        """``SET LOCAL synchronous_commit = off``."""
        conn.execute(sa.text("SET LOCAL synchronous_commit = off"))


def update_or_insert(
    table: sa.Table, *, update: Sequence[str], where: sa.ColumnElement[bool]
) -> sa.Executable:
    """An upsert by ``event_id`` of whole rows (:data:`WHOLE_ROW`) that never inserts a
    row that exists.

    ``WITH u AS (UPDATE ... SET <update> WHERE event_id = :event_id AND <where>)
    INSERT ... SELECT :values WHERE NOT EXISTS (<the row>)``: PostgreSQL checks
    ``NOT NULL`` before ``ON CONFLICT`` looks for the row, so an ``INSERT ... ON
    CONFLICT`` into a table with a ``NOT NULL`` column of the team's own would fail
    even for a row that is there. A missing row (removed by cleanup, or deleted by
    the team) is still inserted, which such a column refuses.
    """

    def value(field: str) -> sa.BindParameter[Any]:
        return sa.bindparam(field, type_=table.c[field].type)

    # The UPDATE on a copy whose column keys no row's value has: SQLAlchemy adds a SET
    # for every execution parameter named like a column key, even in a CTE.
    copy = sa.Table(
        table.name,
        sa.MetaData(),
        *[sa.Column(col.name, col.type, key=f"set_{col.key}") for col in table.columns],
        schema=table.schema,
    )

    def on_copy(element: ExternallyTraversible, **_: Any) -> ExternallyTraversible | None:
        if isinstance(element, sa.Column) and element.table is table:
            return copy.c[f"set_{element.key}"]
        return None

    u = copy.c
    where_on_copy = replacement_traverse(where, {}, on_copy)
    updated = (
        sa.update(copy)
        .where(u.set_event_id == value("event_id"), where_on_copy)
        .values({u[f"set_{field}"]: value(field) for field in update})
        .cte("updated")
    )
    c = table.c
    there = sa.select(c.id).where(c.event_id == value("event_id")).exists()
    missing = sa.select(*[value(field) for field in WHOLE_ROW]).where(~there)
    return sa.insert(table).from_select(list(WHOLE_ROW), missing).add_cte(updated)


def deferred_index(outbox: sa.Table) -> sa.Index:
    """``(lease_until) WHERE`` deferred: the few rows waiting in the table, in hand-over order.

    On a copy of the table: it is made by ``install --source wal`` only. The
    ordering column keeps the table's name for it (``outbox_seq`` of an adopted table).
    """
    copy = sa.Table(
        outbox.name,
        sa.MetaData(),
        sa.Column(outbox.c.id.name, sa.BigInteger(), key="id"),
        sa.Column("state", sa.SmallInteger()),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        schema=outbox.schema,
    )
    c = copy.c
    return sa.Index(
        f"ix_{outbox.name}_wal_deferred",
        c.lease_until,
        c.id,
        postgresql_where=sa.and_(in_state(c.state, State.PENDING), c.lease_owner == DEFERRED),
        # Built while producers insert (install on a live table).
        postgresql_concurrently=True,
    )


class WalTable(LogTable):
    """The outbox table's statements for log tailing (PostgreSQL only)."""

    def __init__(self, dialect: Dialect) -> None:
        from outbox_core.dialects.postgresql import PostgresqlDialect

        if not isinstance(dialect, PostgresqlDialect):
            raise UnsupportedDatabase(
                f"--source wal reads PostgreSQL's logical replication, not {dialect.family}: "
                "use --source table"
            )
        super().__init__(dialect, PostgresWrites(adopted=dialect.tables.adopted))
        self.deferred_index = deferred_index(self.table)

    def install(self, conn: Connection) -> None:
        """Create ``<table>_wal`` and the deferred rows' index where missing
        (``outbox install --source wal``)."""
        progress = self.progress
        with self.dialect.transaction(conn):
            progress.table.create(conn, checkfirst=True)
            name = conn.dialect.identifier_preparer.format_table(progress.table)
            for column in progress.absent(conn):
                kind = column.type.compile(dialect=conn.dialect)
                conn.execute(
                    sa.text(f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {column.name} {kind}")
                )
        progress.reread()
        # CREATE INDEX CONCURRENTLY runs outside a transaction.
        with conn.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as auto:
            self.deferred_index.create(auto, checkfirst=True)

    def missing(self, conn: Connection) -> list[str]:
        """What ``install --source wal`` makes and the table lacks (a table installed
        before them): the relay runs without, slower or unseen by status."""
        found = {
            ix["name"] for ix in sa.inspect(conn).get_indexes(self.table.name, self.table.schema)
        }
        progress = self.progress
        gone = [] if progress.exists(conn) else [progress.table.name]
        absent = progress.absent(conn) if not gone else []
        if absent:
            named = ", ".join(c.name for c in absent)
            gone.append(f"{progress.table.name}'s column(s) {named}")
        if self.deferred_index.name not in found:
            gone.append(str(self.deferred_index.name))
        return gone

    def uninstall(self, conn: Connection) -> None:
        """Drop ``<table>_wal`` and the index if they exist (``outbox uninstall --source wal``)."""
        with self.dialect.transaction(conn):
            self.progress.table.drop(conn, checkfirst=True)
        with conn.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as auto:
            self.deferred_index.drop(auto, checkfirst=True)

    def slot_status(self, conn: Connection, slot: str) -> TailingStatus:
        """The slot, its relay's last report and the oldest unpublished event's age."""
        return source_status(conn, self, slot, slot_source_facts(conn, slot), format_lsn)


def slot_source_facts(conn: Connection, slot: str) -> SourceFacts | None:
    """The slot as ``pg_replication_slots`` shows it (None: it does not exist)."""
    facts = slot_facts(conn, slot)
    if facts is None:
        return None
    return SourceFacts(
        active=facts.active,
        reader_pid=facts.active_pid,
        confirmed=facts.confirmed_flush_lsn,
        lag_bytes=facts.lag_bytes,
        retained_bytes=facts.retained_bytes,
    )
