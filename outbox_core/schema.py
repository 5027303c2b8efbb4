"""The outbox and inbox tables: the single source of DDL for every dialect.

``create_all``, ``outbox schema --dialect X`` and Alembic autogenerate all read
these definitions. Per-database types are expressed as SQLAlchemy variants:

* ``event_id``: native ``UUID`` on PostgreSQL, ``CHAR(36)`` elsewhere.
* ``payload`` / ``headers``: ``JSONB`` on PostgreSQL, ``JSON`` on MySQL/MariaDB,
  ``NVARCHAR(max)`` on SQL Server, ``JSON`` (text) on SQLite.
* timestamps: ``TIMESTAMPTZ`` on PostgreSQL, ``DATETIME(6)`` on MySQL,
  ``DATETIME2`` on SQL Server; all hold UTC.

For Alembic, point ``target_metadata`` at :data:`metadata` (default names) or
at ``OutboxTables(...).metadata`` for custom names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import SchemaItem
from sqlalchemy.sql.compiler import DDLCompiler
from sqlalchemy.sql.ddl import BaseDDLElement

from outbox_core.columns import ColumnMap
from outbox_core.identifiers import validate_identifier
from outbox_core.message import State

DEFAULT_TABLE = "outbox"


def _timestamp() -> sa.types.TypeEngine[datetime]:
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(mssql.DATETIME2(precision=6), "mssql")  # type: ignore[no-untyped-call]
        .with_variant(sa.DateTime(), "sqlite")
    )


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _build_outbox(
    metadata: sa.MetaData, name: str, schema: str | None, columns: ColumnMap | None = None
) -> sa.Table:
    # ``key=``: Python code names a column by its field, SQL by the table's own name.
    cols = columns or ColumnMap()
    return sa.Table(
        name,
        metadata,
        # INTEGER PRIMARY KEY on SQLite makes it the rowid (auto-increment).
        sa.Column(
            cols.id,
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            key="id",
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column(
            cols.event_id,
            sa.CHAR(36).with_variant(postgresql.UUID(as_uuid=False), "postgresql"),
            key="event_id",
            nullable=False,
        ),
        sa.Column(cols.topic, sa.Unicode(255), key="topic", nullable=False),
        sa.Column(cols.key, sa.Unicode(255), key="key", nullable=True),
        sa.Column(cols.payload, _json(), key="payload", nullable=False),
        sa.Column(cols.headers, _json(), key="headers", nullable=True),
        sa.Column("state", sa.SmallInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("available_at", _timestamp(), nullable=False),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", _timestamp(), nullable=True),
        sa.Column(cols.created_at, _timestamp(), key="created_at", nullable=False),
        sa.Column("sent_at", _timestamp(), nullable=True),
        sa.Column(
            "last_error",
            sa.UnicodeText().with_variant(mssql.NVARCHAR(None), "mssql"),
            nullable=True,
        ),
        # The key's partition (outbox_core.partitions), written at enqueue.
        # NULL in rows an earlier version wrote: relays compute it then. Last,
        # where `outbox install` adds it to a table created before it.
        sa.Column("key_partition", sa.SmallInteger(), nullable=True),
        sa.Index(f"ux_{name}_event_id", "event_id", unique=True),
        schema=schema,
        # AUTOINCREMENT: SQLite never reuses a deleted id, so ids stay in insertion order.
        sqlite_autoincrement=True,
    )


class _HasPartialIndexes:
    """A ``ddl_if`` condition: the database has partial indexes (or, ``wanted=False``, not).

    Its dialect class says (``Dialect.partial_indexes``); no database name is compared here.
    """

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted

    def __call__(
        self,
        ddl: BaseDDLElement,
        target: SchemaItem | str,
        bind: sa.Connection | None,
        tables: list[sa.Table] | None = None,
        state: Any | None = None,
        *,
        dialect: sa.Dialect,
        compiler: DDLCompiler | None = None,
        checkfirst: bool = False,
    ) -> bool:
        # Imported here: the dialects are built on this module.
        from outbox_core.dialects.base.names import load_dialect

        family, _ = load_dialect(dialect.name)
        return family.partial_indexes is self.wanted


_partial = _HasPartialIndexes(True)
_composite = _HasPartialIndexes(False)


def _partial_index(name: str, *columns: sa.Column[Any], where: sa.ColumnElement[bool]) -> None:
    # SQLAlchemy's per-database keyword for the predicate; each database reads its own.
    sa.Index(name, *columns, postgresql_where=where, sqlite_where=where, mssql_where=where).ddl_if(
        callable_=_partial
    )


def built_on(index: sa.Index, partial_indexes: bool) -> bool:
    """``index`` is created on a database with (or without) partial indexes.

    The work indexes come in two sets (:func:`_add_work_indexes`), each
    created only where its ``ddl_if`` condition holds; other indexes everywhere.
    """
    condition = getattr(index, "_ddl_if", None)
    check = getattr(condition, "callable_", None)
    return not isinstance(check, _HasPartialIndexes) or check.wanted is partial_indexes


def in_state(column: sa.ColumnElement[int], *states: int) -> sa.ColumnElement[bool]:
    """``state = 0`` or ``state IN (1, 3)``, the values written into the SQL, not bound.

    A partial (filtered) index serves a query only when the query's WHERE
    implies the index's at plan time: a bound ``state = ?`` never does on SQL
    Server and SQLite, and may not in a generic plan of a statement
    PostgreSQL has prepared. States are a handful of constants, so literals
    cost no statement-cache entries.
    """
    values = [sa.literal_column(str(int(s)), sa.SmallInteger()) for s in states]
    return column == values[0] if len(values) == 1 else column.in_(values)


def _add_work_indexes(table: sa.Table) -> None:
    """The indexes claims, settles and the reaper read: only rows still to deliver.

    Every claim and every settle changes ``state``, so each such update writes
    a new entry into every index whose columns or predicate it touches (on
    PostgreSQL none of them can be a HOT update). Sent rows, the history that
    grows without bound, are kept out of all of them where the database has
    partial indexes:

    * ``ix_<t>_pending (id) WHERE state = 0``: unordered claims, oldest first;
    * ``ix_<t>_pending_key (key, id) WHERE state = 0``: ordered claims, the
      loose scan over keys with pending rows and each key's run;
    * ``ix_<t>_leased (key, id) WHERE state = 1`` and ``ix_<t>_dead (key, id)
      WHERE state = 3``: the head-of-key check (an earlier leased or dead row
      of the key), the reaper and ``outbox status`` (few rows each). One
      index per state, not one for both: SQLite uses a partial index only
      when the query repeats its predicate term for term, and each check
      asks for one state.

    A claim then writes the primary key, ``event_id`` and ``leased``;
    marking sent writes only the primary key and ``event_id`` (before: five
    indexes each). Cleanup of old sent rows walks the primary key from the
    oldest id.

    MySQL and MariaDB have no partial indexes: ``(state, id)`` and ``(state,
    key, id)`` lead with state, so InnoDB's claim ranges never cover leased or
    sent rows (it locks the rows it scans); the leased and dead checks are
    ranges of ``(state, key, id)`` too.
    """
    name = table.name
    c = table.c
    _partial_index(f"ix_{name}_pending", c.id, where=in_state(c.state, State.PENDING))
    _partial_index(f"ix_{name}_pending_key", c.key, c.id, where=in_state(c.state, State.PENDING))
    _partial_index(f"ix_{name}_leased", c.key, c.id, where=in_state(c.state, State.LEASED))
    _partial_index(f"ix_{name}_dead", c.key, c.id, where=in_state(c.state, State.DEAD))
    sa.Index(f"ix_{name}_state_id", c.state, c.id).ddl_if(callable_=_composite)
    sa.Index(f"ix_{name}_state_key_id", c.state, c.key, c.id).ddl_if(callable_=_composite)


def obsolete_indexes(table: sa.Table, partial_indexes: bool) -> list[str]:
    """Indexes earlier versions created that ``outbox install`` now drops.

    ``(state, lease_until)`` everywhere (the reaper reads the few leased rows
    through ``leased`` or ``(state, key, id)``), and where partial indexes
    exist, the full ``(state, id)`` and ``(state, key, id)``, which also
    indexed every sent row.
    """
    name = table.name
    old = [f"ix_{name}_state_lease"]
    if partial_indexes:
        old += [f"ix_{name}_state_id", f"ix_{name}_state_key_id"]
    return old


def detached_index(table: sa.Table, name: str) -> sa.Index:
    """An index named ``name`` on a detached copy of ``table``: enough to drop it.

    An index built on ``table`` itself would join its metadata (and be
    created by the next ``create_all``).
    """
    copy = sa.Table(table.name, sa.MetaData(), sa.Column("state"), schema=table.schema)
    return sa.Index(name, copy.c.state)


def _build_inbox(metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        sa.Column("consumer", sa.Unicode(128), primary_key=True),
        sa.Column(
            "event_id",
            sa.CHAR(36).with_variant(postgresql.UUID(as_uuid=False), "postgresql"),
            primary_key=True,
        ),
        sa.Column("processed_at", _timestamp(), nullable=False),
        sa.Index(f"ix_{name}_processed_at", "processed_at"),
        schema=schema,
    )


def _build_relays(metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    """The membership of ordered relays: who is alive, and which partitions each owns.

    One row per relay, its heartbeat written on the database's clock.
    ``partitions`` is the relay's share (``0-63,128``) of the split last
    agreed, ``epoch`` the number of that split: a rebalance locks every row,
    so it waits for claims in flight, which lock their own relay's row.
    """
    return sa.Table(
        name,
        metadata,
        sa.Column("relay_id", sa.String(64), primary_key=True),
        sa.Column("host", sa.Unicode(255), nullable=False),
        sa.Column("joined_at", _timestamp(), nullable=False),
        sa.Column("heartbeat_at", _timestamp(), nullable=False),
        sa.Column("partitions", sa.String(2000), nullable=False, server_default=""),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        schema=schema,
    )


def _build_presence(metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    """Every running relay, whatever its mode: who, where, since when and how busy.

    One row per relay, written by that relay alone every few seconds on the
    database's clock (``relay_id`` is the membership table's id for an
    ordered relay by key partitions, so the two join), deleted when it stops
    cleanly; a row left by a killed relay ages until another relay removes it.
    """
    return sa.Table(
        name,
        metadata,
        sa.Column("relay_id", sa.String(64), primary_key=True),
        sa.Column("host", sa.Unicode(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        # none, partitions, heads (the polling relay's ordering) or wal (log tailing).
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=False),
        sa.Column("heartbeat_at", _timestamp(), nullable=False),
        # Since the relay started: events the broker accepted, events made dead.
        sa.Column("published", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("dead", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column(
            "published_last_minute", sa.Integer(), nullable=False, server_default=sa.text("0")
        ),
        schema=schema,
    )


def missing_columns(table: sa.Table, present: set[str]) -> list[sa.Column[Any]]:
    """Columns of ``table`` a table created by an earlier version lacks (all nullable)."""
    return [c for c in table.columns if c.name.lower() not in present and c.nullable]


@dataclass(frozen=True)
class OutboxTables:
    """The outbox table and its companions, under validated names.

    ``OutboxTables.create("events", schema="app")`` defines ``app.events``,
    ``app.events_inbox`` (the inbox), ``app.events_relays`` (the membership of
    ordered relays) and ``app.events_presence`` (every running relay) in its
    own :class:`~sqlalchemy.MetaData`.
    """

    metadata: sa.MetaData
    outbox: sa.Table
    inbox: sa.Table
    relays: sa.Table
    presence: sa.Table
    #: Which column holds each field (the default: the toolkit's own layout).
    columns: ColumnMap = field(default_factory=ColumnMap)

    @classmethod
    def create(
        cls,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        metadata: sa.MetaData | None = None,
        columns: ColumnMap | str | Mapping[str, Any] | None = None,
    ) -> OutboxTables:
        """Define the tables, validating ``table``, ``schema`` and ``columns`` as identifiers.

        ``columns`` (:meth:`ColumnMap.parse`) names the columns of an existing
        table that hold the toolkit's fields.
        """
        validate_identifier(table, "table name")
        if schema is not None:
            validate_identifier(schema, "schema name")
        mapping = ColumnMap.parse(columns)
        md = metadata if metadata is not None else sa.MetaData()
        outbox = _build_outbox(md, table, schema, mapping)
        _add_work_indexes(outbox)
        inbox = _build_inbox(md, f"{table}_inbox", schema)
        relays = _build_relays(md, f"{table}_relays", schema)
        presence = _build_presence(md, f"{table}_presence", schema)
        return cls(md, outbox, inbox, relays, presence, mapping)

    @property
    def adopted(self) -> bool:
        """The outbox table is one of the team's own, read through a :class:`ColumnMap`."""
        return not self.columns.is_default

    @property
    def companions(self) -> list[sa.Table]:
        """The inbox, membership and presence tables (always the toolkit's layout)."""
        return [self.inbox, self.relays, self.presence]

    @property
    def all(self) -> list[sa.Table]:
        """The four tables, in the order they are created."""
        return [self.outbox, self.inbox, self.relays, self.presence]

    def create_all(
        self, bind: sa.Connection | sa.Engine, tables: list[sa.Table] | None = None
    ) -> None:
        """Create the tables, their columns and their indexes where they are missing.

        Columns and indexes are checked one by one, so ``outbox install``
        also adds a column or an index a newer version introduced to tables
        created before it. ``tables``: only these (default: :attr:`all`).
        """
        chosen = self.all if tables is None else tables
        if isinstance(bind, sa.Engine):
            with bind.begin() as conn:
                self.create_all(conn, chosen)
            return
        self.metadata.create_all(bind, tables=chosen, checkfirst=True)
        inspector = sa.inspect(bind)
        for table in chosen:
            present = {c["name"].lower() for c in inspector.get_columns(table.name, table.schema)}
            for column in missing_columns(table, present):
                bind.execute(AddColumn(table, column))
        for table in chosen:
            for index in sorted(table.indexes, key=lambda i: str(i.name)):
                # ddl_if (the partial pending index) is honoured by create().
                index.create(bind, checkfirst=True)

    def ddl(self, dialect_name: str) -> str:
        """Return the DDL ``create_all`` would run on ``dialect_name``, without connecting."""
        statements: list[str] = []

        def record(sql: sa.schema.ExecutableDDLElement, *_: object, **__: object) -> None:
            statements.append(str(sql.compile(dialect=engine.dialect)).strip())

        engine = sa.create_mock_engine(sa.engine.URL.create(dialect_name), record)
        self.metadata.create_all(engine, tables=self.all, checkfirst=False)
        return ";\n\n".join(statements) + ";\n"


class AddColumn(sa.schema.ExecutableDDLElement):
    """``ALTER TABLE t ADD <column>``: the column as ``CREATE TABLE`` would declare it.

    Core has no such construct (Alembic has); ``ADD`` without ``COLUMN`` is
    what every supported database accepts.
    """

    inherit_cache = False

    def __init__(self, table: sa.Table, column: sa.Column[Any]) -> None:
        self.table = table
        self.column = column


@compiles(AddColumn)
def _add_column(element: AddColumn, compiler: DDLCompiler, **kw: Any) -> str:
    table = compiler.preparer.format_table(element.table)
    column = compiler.process(sa.schema.CreateColumn(element.column), **kw)
    return f"ALTER TABLE {table} ADD {column}"


_default = OutboxTables.create()
#: MetaData holding the default ``outbox`` and ``outbox_inbox`` tables (for Alembic).
metadata: sa.MetaData = _default.metadata
#: The default ``outbox`` table.
outbox_table: sa.Table = _default.outbox
#: The default ``outbox_inbox`` table.
inbox_table: sa.Table = _default.inbox
