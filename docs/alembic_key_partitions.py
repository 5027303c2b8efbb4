"""Add key partitions: the outbox's ``key_partition`` column and the relay membership table.

The Alembic revision after ``alembic_example.py`` (``outbox install`` does the
same on tables an earlier version created): copy it into your ``versions/``
folder after that one, or set ``down_revision`` to the revision that created
your outbox table. Rows already in the table keep ``key_partition`` NULL:
relays compute it from the key. ``tests/unit/test_migrate_unit.py`` checks
that both revisions together give the toolkit's tables on every dialect.

Revision ID: 0002_outbox_key_partitions
Revises: 0001_outbox_tables
Create Date: 2026-11-24 00:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mssql, mysql

revision = "0002_outbox_key_partitions"
down_revision: str | None = "0001_outbox_tables"
branch_labels: str | None = None
depends_on: str | None = None

TABLE = "outbox"
SCHEMA: str | None = None
RELAYS = f"{TABLE}_relays"


def _timestamp() -> Any:
    # UTC everywhere: TIMESTAMPTZ, DATETIME(6), DATETIME2(6), SQLite text.
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(mssql.DATETIME2(precision=6), "mssql")
        .with_variant(sa.DateTime(), "sqlite")
    )


def upgrade() -> None:
    """Add the partition column and create the membership table of ordered relays."""
    op.add_column(
        TABLE, sa.Column("key_partition", sa.SmallInteger(), nullable=True), schema=SCHEMA
    )
    op.create_table(
        RELAYS,
        sa.Column("relay_id", sa.String(64), primary_key=True),
        sa.Column("host", sa.Unicode(255), nullable=False),
        sa.Column("joined_at", _timestamp(), nullable=False),
        sa.Column("heartbeat_at", _timestamp(), nullable=False),
        sa.Column("partitions", sa.String(2000), nullable=False, server_default=""),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Drop the membership table and the partition column."""
    op.drop_table(RELAYS, schema=SCHEMA)
    op.drop_column(TABLE, "key_partition", schema=SCHEMA)
