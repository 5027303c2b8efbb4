"""Add the presence table: a row per running relay, whatever its mode.

The Alembic revision after ``alembic_key_partitions.py`` (``outbox install``
does the same on tables an earlier version created): copy it into your
``versions/`` folder after that one. Relays run without the table until it
exists, saying so once at start; ``Outbox.fleet()``, ``outbox status`` and the
dashboard list the relays from it. ``tests/unit/test_migrate_unit.py`` checks
that the revisions together give the toolkit's tables on every dialect.

Revision ID: 0003_outbox_presence
Revises: 0002_outbox_key_partitions
Create Date: 2027-01-15 00:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mssql, mysql

revision = "0003_outbox_presence"
down_revision: str | None = "0002_outbox_key_partitions"
branch_labels: str | None = None
depends_on: str | None = None

TABLE = "outbox"
SCHEMA: str | None = None
PRESENCE = f"{TABLE}_presence"


def _timestamp() -> Any:
    # UTC everywhere: TIMESTAMPTZ, DATETIME(6), DATETIME2(6), SQLite text.
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(mssql.DATETIME2(precision=6), "mssql")
        .with_variant(sa.DateTime(), "sqlite")
    )


def upgrade() -> None:
    """Create the presence table."""
    op.create_table(
        PRESENCE,
        sa.Column("relay_id", sa.String(64), primary_key=True),
        sa.Column("host", sa.Unicode(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=False),
        sa.Column("heartbeat_at", _timestamp(), nullable=False),
        sa.Column("published", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("dead", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column(
            "published_last_minute", sa.Integer(), nullable=False, server_default=sa.text("0")
        ),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Drop the presence table."""
    op.drop_table(PRESENCE, schema=SCHEMA)
