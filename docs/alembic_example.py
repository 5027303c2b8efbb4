"""Create the outbox and inbox tables.

An Alembic revision equivalent to ``outbox install`` (``OutboxTables.create()``
in ``outbox_core/schema.py``): copy it into your ``versions/`` folder, set
``down_revision`` to your latest revision, and change ``TABLE`` / ``SCHEMA`` if
you do not use the default ``outbox`` table. The definitions are written out
(not imported from the toolkit) so this revision never changes after it ran;
``tests/unit/test_migrate_unit.py`` checks it still produces the toolkit's DDL
on every dialect.

Revision ID: 0001_outbox_tables
Revises:
Create Date: 2024-06-01 00:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mssql, mysql, postgresql

revision = "0001_outbox_tables"
down_revision: str | None = None  # your latest revision
branch_labels: str | None = None
depends_on: str | None = None

TABLE = "outbox"
SCHEMA: str | None = None
INBOX = f"{TABLE}_inbox"


#: Databases with partial (filtered) indexes.
PARTIAL = ("postgresql", "sqlite", "mssql")
#: (name, columns, state) of each partial index: pending (0), leased (1), dead (3).
_WORK_INDEXES = [
    ("ix_{}_pending", ["id"], 0),
    ("ix_{}_pending_key", ["key", "id"], 0),
    ("ix_{}_leased", ["key", "id"], 1),
    ("ix_{}_dead", ["key", "id"], 3),
]


def _timestamp() -> Any:
    # UTC everywhere: TIMESTAMPTZ, DATETIME(6), DATETIME2(6), SQLite text.
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(mssql.DATETIME2(precision=6), "mssql")
        .with_variant(sa.DateTime(), "sqlite")
    )


def _json() -> Any:
    # JSONB on PostgreSQL, JSON on MySQL/MariaDB and SQLite, NVARCHAR(max) on SQL Server.
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _event_id() -> Any:
    return sa.CHAR(36).with_variant(postgresql.UUID(as_uuid=False), "postgresql")


def upgrade() -> None:
    """Create the outbox table, its indexes and the inbox table."""
    op.create_table(
        TABLE,
        # INTEGER PRIMARY KEY AUTOINCREMENT on SQLite: ids never reused, always increasing.
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("event_id", _event_id(), nullable=False),
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
        schema=SCHEMA,
        sqlite_autoincrement=True,
    )
    op.create_index(f"ux_{TABLE}_event_id", TABLE, ["event_id"], unique=True, schema=SCHEMA)
    # The indexes claims read, covering only rows still to deliver where the
    # database has partial indexes; MySQL/MariaDB lead with state instead
    # (InnoDB locks the rows a claim scans). get_context works offline too,
    # with `alembic upgrade --sql`.
    if op.get_context().dialect.name in PARTIAL:
        for name, columns, state in _WORK_INDEXES:
            where = sa.text(f"state = {state}")
            op.create_index(
                name.format(TABLE),
                TABLE,
                columns,
                schema=SCHEMA,
                postgresql_where=where,
                sqlite_where=where,
                mssql_where=where,
            )
    else:
        op.create_index(f"ix_{TABLE}_state_id", TABLE, ["state", "id"], schema=SCHEMA)
        op.create_index(f"ix_{TABLE}_state_key_id", TABLE, ["state", "key", "id"], schema=SCHEMA)
    op.create_table(
        INBOX,
        sa.Column("consumer", sa.Unicode(128), primary_key=True),
        sa.Column("event_id", _event_id(), primary_key=True),
        sa.Column("processed_at", _timestamp(), nullable=False),
        schema=SCHEMA,
    )
    op.create_index(f"ix_{INBOX}_processed_at", INBOX, ["processed_at"], schema=SCHEMA)


def downgrade() -> None:
    """Drop both tables (and with them every event they hold)."""
    op.drop_index(f"ix_{INBOX}_processed_at", table_name=INBOX, schema=SCHEMA)
    op.drop_table(INBOX, schema=SCHEMA)
    if op.get_context().dialect.name in PARTIAL:
        names = [name for name, _, _ in _WORK_INDEXES]
    else:
        names = ["ix_{}_state_id", "ix_{}_state_key_id"]
    for name in [*names, "ux_{}_event_id"]:
        op.drop_index(name.format(TABLE), table_name=TABLE, schema=SCHEMA)
    op.drop_table(TABLE, schema=SCHEMA)
