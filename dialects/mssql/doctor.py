"""SQL Server diagnostics of ``outbox doctor``: READ_COMMITTED_SNAPSHOT and the claim hints."""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from outbox_core.doctor.model import DoctorContext, Finding, Severity


def isolation(ctx: DoctorContext) -> Iterable[Finding]:
    """READ_COMMITTED_SNAPSHOT and what it means for the claim hints."""
    databases = sa.table(
        "databases",
        sa.column("name"),
        sa.column("is_read_committed_snapshot_on"),
        sa.column("snapshot_isolation_state_desc"),
        schema="sys",
    )
    rcsi, snapshot, database = ctx.conn.execute(
        sa.select(
            databases.c.is_read_committed_snapshot_on,
            databases.c.snapshot_isolation_state_desc,
            databases.c.name,
        ).where(databases.c.name == sa.func.db_name())
    ).one()
    details = {"read_committed_snapshot": bool(rcsi), "snapshot_isolation": snapshot}
    if rcsi:
        message = (
            "READ_COMMITTED_SNAPSHOT is ON: plain reads see the last committed version "
            "instead of waiting for locks; claims keep UPDLOCK with READPAST, so two relays "
            "still never lease the same row"
        )
        fix = None
    else:
        message = (
            "READ_COMMITTED_SNAPSHOT is OFF: claims skip locked rows with READPAST, but plain "
            "readers at READ COMMITTED (outbox status, your reports) wait for rows a claim "
            "or a producer holds"
        )
        db = ctx.conn.dialect.identifier_preparer.quote(str(database))
        fix = (
            f"optional: ALTER DATABASE {db} SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE"
        )
    yield Finding("isolation", Severity.OK, message, fix=fix, details=details)


#: The checks this database adds to ``outbox doctor``, by finding name.
CHECKS = [("isolation", isolation)]
