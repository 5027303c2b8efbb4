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

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql

from outbox_core.errors import InvalidIdentifier

DEFAULT_TABLE = "outbox"
# Long enough for real names, short enough that index names stay under
# PostgreSQL's 63-character limit.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")


def validate_identifier(name: str, what: str = "table name") -> str:
    """Return ``name`` if it is a plain identifier, else raise :class:`InvalidIdentifier`."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidIdentifier(
            f"invalid {what} {name!r}: use 1-48 letters, digits or underscores, "
            "not starting with a digit"
        )
    return name


def _timestamp() -> sa.types.TypeEngine[datetime]:
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(mssql.DATETIME2(precision=6), "mssql")  # type: ignore[no-untyped-call]
        .with_variant(sa.DateTime(), "sqlite")
    )


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _build_outbox(metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        # INTEGER PRIMARY KEY on SQLite makes it the rowid (auto-increment).
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column(
            "event_id",
            sa.CHAR(36).with_variant(postgresql.UUID(as_uuid=False), "postgresql"),
            nullable=False,
        ),
        sa.Column("topic", sa.Unicode(255), nullable=False),
        sa.Column("key", sa.Unicode(255), nullable=True),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("headers", _json(), nullable=True),
        sa.Column("state", sa.SmallInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("available_at", _timestamp(), nullable=False),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", _timestamp(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("sent_at", _timestamp(), nullable=True),
        sa.Column(
            "last_error",
            sa.UnicodeText().with_variant(mssql.NVARCHAR(None), "mssql"),
            nullable=True,
        ),
        # Every index leads with state: MariaDB locks the rows it scans, so
        # leased and sent rows must fall outside a claim's range. (state, key,
        # id) serves ordered claims: a loose scan of the keys with pending rows,
        # and each key's first rows, without reading sent history.
        sa.Index(f"ix_{name}_state_id", "state", "id"),
        sa.Index(f"ix_{name}_state_key_id", "state", "key", "id"),
        sa.Index(f"ix_{name}_state_lease", "state", "lease_until"),
        sa.Index(f"ux_{name}_event_id", "event_id", unique=True),
        schema=schema,
        # AUTOINCREMENT: SQLite never reuses a deleted id, so ids stay in insertion order.
        sqlite_autoincrement=True,
    )


def _add_pending_index(table: sa.Table) -> None:
    # A partial index where the database has them: the claim's hot path stays
    # small however many sent rows are kept.
    sa.Index(
        f"ix_{table.name}_pending",
        table.c.id,
        postgresql_where=table.c.state == 0,
        sqlite_where=table.c.state == 0,
        mssql_where=table.c.state == 0,
    ).ddl_if(dialect=("postgresql", "sqlite", "mssql"))  # type: ignore[arg-type]  # documented


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


@dataclass(frozen=True)
class OutboxTables:
    """The outbox table and its inbox table, under validated names.

    ``OutboxTables("events", schema="app")`` defines ``app.events`` and
    ``app.events_inbox`` in its own :class:`~sqlalchemy.MetaData`.
    """

    metadata: sa.MetaData
    outbox: sa.Table
    inbox: sa.Table

    @classmethod
    def create(
        cls,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        metadata: sa.MetaData | None = None,
    ) -> OutboxTables:
        """Define the tables, validating ``table`` and ``schema`` as identifiers."""
        validate_identifier(table, "table name")
        if schema is not None:
            validate_identifier(schema, "schema name")
        md = metadata if metadata is not None else sa.MetaData()
        outbox = _build_outbox(md, table, schema)
        _add_pending_index(outbox)
        inbox = _build_inbox(md, f"{table}_inbox", schema)
        return cls(md, outbox, inbox)

    def create_all(self, bind: sa.Connection | sa.Engine) -> None:
        """Create both tables and their indexes if they are missing.

        Indexes are checked one by one, so ``outbox install`` also adds an
        index a newer version introduced to tables created before it.
        """
        self.metadata.create_all(bind, tables=[self.outbox, self.inbox], checkfirst=True)
        for table in (self.outbox, self.inbox):
            for index in sorted(table.indexes, key=lambda i: str(i.name)):
                # ddl_if (the partial pending index) is honoured by create().
                index.create(bind, checkfirst=True)

    def ddl(self, dialect_name: str) -> str:
        """Return the DDL ``create_all`` would run on ``dialect_name``, without connecting."""
        statements: list[str] = []

        def record(sql: sa.schema.ExecutableDDLElement, *_: object, **__: object) -> None:
            statements.append(str(sql.compile(dialect=engine.dialect)).strip())

        engine = sa.create_mock_engine(sa.engine.URL.create(dialect_name), record)
        self.metadata.create_all(engine, tables=[self.outbox, self.inbox], checkfirst=False)
        return ";\n\n".join(statements) + ";\n"


_default = OutboxTables.create()
#: MetaData holding the default ``outbox`` and ``outbox_inbox`` tables (for Alembic).
metadata: sa.MetaData = _default.metadata
#: The default ``outbox`` table.
outbox_table: sa.Table = _default.outbox
#: The default ``outbox_inbox`` table.
inbox_table: sa.Table = _default.inbox
