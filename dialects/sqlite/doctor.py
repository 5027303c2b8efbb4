"""SQLite diagnostics of ``outbox doctor``: one writer at a time, WAL, a mistyped file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import sqlalchemy as sa

from outbox_core.doctor.family import FamilyDoctor
from outbox_core.doctor.model import DoctorContext, Finding, Severity


def isolation(ctx: DoctorContext) -> Iterable[Finding]:
    """SQLite has no isolation levels to get wrong: one writer at a time."""
    yield Finding(
        "isolation",
        Severity.OK,
        "SQLite runs one writer at a time: each claim is a BEGIN IMMEDIATE transaction",
    )


def journal_mode(ctx: DoctorContext) -> Iterable[Finding]:
    """WAL lets readers go on while a claim or a producer writes."""
    # PRAGMA has no Core construct.
    mode = str(ctx.conn.execute(sa.text("PRAGMA journal_mode")).scalar_one()).lower()
    details = {"journal_mode": mode}
    if mode in ("wal", "memory"):
        yield Finding("journal_mode", Severity.OK, f"journal_mode is {mode}", details=details)
        return
    database = ctx.outbox.url.database or "<file>"
    yield Finding(
        "journal_mode",
        Severity.WARNING,
        f"journal_mode is {mode}, not WAL: while a claim or a producer writes, readers wait, "
        "and relays and producers see 'database is locked' more often",
        fix=f"sqlite3 {database} 'PRAGMA journal_mode=WAL;' (persistent; outbox install "
        "sets it too)",
        details=details,
    )


def missing_file(database: str | None, install_command: str) -> Finding | None:
    """Connecting would create a mistyped SQLite file: report it instead."""
    if not database or database == ":memory:":
        return None
    if database.startswith("file:") or Path(database).exists():
        return None
    return Finding(
        "connection",
        Severity.ERROR,
        f"the SQLite database file {database} does not exist",
        fix=f"check the path; {install_command} creates it",
    )


#: The checks this database adds to ``outbox doctor``, by finding name.
CHECKS = [("isolation", isolation), ("journal_mode", journal_mode)]

DOCTOR = FamilyDoctor(
    checks=CHECKS,
    locking=(
        "claims take turns on the database's write lock (BEGIN IMMEDIATE; SQLite has "
        "no row locks) and leases keep relays apart"
    ),
    upgrade_hint=("use a Python whose sqlite3 links SQLite 3.35 or newer (UPDATE ... RETURNING)"),
    can_add_primary_key=False,
    preflight=lambda url, install_command: missing_file(url.database, install_command),
)
