"""SQL Server diagnostics of ``outbox doctor``.

Each check follows a decision of the dialect (its module docstring cites
Microsoft's pages): READ_COMMITTED_SNAPSHOT for ordered claims, lock
escalation turned off on the outbox table, and the SET options that writing
a table with filtered indexes needs.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from outbox_core.dialects import mssql
from outbox_core.dialects.mssql import SYS_DATABASES, MssqlDialect, this_database
from outbox_core.doctor.family import FamilyDoctor
from outbox_core.doctor.model import DoctorContext, Finding, Severity

#: SESSIONPROPERTY name -> the value writing a filtered-index table needs.
#: ARITHABORT is left out: ODBC sessions report it OFF, but with ANSI_WARNINGS
#: ON (checked here) and compatibility level 90 or higher SQL Server treats it
#: as ON ("Setting ANSI_WARNINGS to ON implicitly sets ARITHABORT to ON").
REQUIRED_OPTIONS = {
    "ANSI_NULLS": 1,
    "ANSI_PADDING": 1,
    "ANSI_WARNINGS": 1,
    "CONCAT_NULL_YIELDS_NULL": 1,
    "QUOTED_IDENTIFIER": 1,
    "NUMERIC_ROUNDABORT": 0,
}


def isolation(ctx: DoctorContext) -> Iterable[Finding]:
    """READ_COMMITTED_SNAPSHOT: needed by ordered relays, kind to every reader."""
    d = SYS_DATABASES
    rcsi, snapshot, database = ctx.conn.execute(
        this_database(
            d.c.is_read_committed_snapshot_on, d.c.snapshot_isolation_state_desc, d.c.name
        )
    ).one()
    details = {"read_committed_snapshot": bool(rcsi), "snapshot_isolation": snapshot}
    if rcsi:
        yield Finding(
            "isolation",
            Severity.OK,
            "READ_COMMITTED_SNAPSHOT is ON: plain reads (the ordered claim's head-of-key "
            "checks, outbox status) see the last committed version instead of waiting for "
            "locks; claims read with UPDLOCK, READPAST, READCOMMITTEDLOCK, so two relays "
            "still never lease the same row",
            details=details,
        )
        return
    db = ctx.conn.dialect.identifier_preparer.quote_identifier(str(database))
    yield Finding(
        "isolation",
        Severity.WARNING,
        "READ_COMMITTED_SNAPSHOT is OFF: unordered claims work (READPAST), but ordered "
        "relays refuse to start: their head-of-key reads would wait for other claims' row "
        "locks and could deadlock; plain readers (outbox status, your reports) wait too",
        fix=f"ALTER DATABASE {db} SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE",
        details=details,
    )


def lock_escalation(ctx: DoctorContext) -> Iterable[Finding]:
    """The outbox table never escalates to a table lock (which READPAST cannot skip)."""
    if "outbox" not in ctx.present:
        return
    setting = mssql.lock_escalation(ctx.conn, ctx.outbox.tables.outbox)
    details = {"lock_escalation": setting}
    if setting == "DISABLE":
        yield Finding(
            "lock_escalation",
            Severity.OK,
            "lock escalation is off for the outbox table",
            details=details,
        )
        return
    dialect = ctx.outbox.dialect
    assert isinstance(dialect, MssqlDialect)
    fix = str(dialect.disable_lock_escalation().compile(dialect=ctx.conn.dialect))
    yield Finding(
        "lock_escalation",
        Severity.WARNING,
        f"lock escalation is {setting} for the outbox table: a statement holding 5,000 row "
        "locks on it (a claim passing over many delayed events, a large delete of your own) "
        "takes a table lock instead, which READPAST cannot skip and which blocks producers "
        "and every relay until it commits",
        fix=fix,
        details=details,
    )


def set_options(ctx: DoctorContext) -> Iterable[Finding]:
    """This session's SET options allow writing a table with filtered indexes."""
    values = ctx.conn.execute(
        # SESSIONPROPERTY returns sql_variant, which older pyodbc cannot fetch: cast it.
        sa.select(
            *(
                sa.cast(sa.func.sessionproperty(name), sa.Integer).label(name)
                for name in REQUIRED_OPTIONS
            )
        )
    ).one()
    wrong = {
        name: int(value)
        for name, value in zip(REQUIRED_OPTIONS, values, strict=True)
        if value is not None and int(value) != REQUIRED_OPTIONS[name]
    }
    if not wrong:
        yield Finding(
            "set_options",
            Severity.OK,
            "this connection's SET options allow writing the outbox's filtered indexes",
        )
        return
    shown = ", ".join(f"{name}={'ON' if v else 'OFF'}" for name, v in wrong.items())
    yield Finding(
        "set_options",
        Severity.ERROR,
        f"this connection has {shown}: SQL Server refuses INSERT and UPDATE on a table with "
        "filtered indexes from such a session (error 1934), so enqueue fails; relays set "
        "their own, but every producer's connection needs the defaults",
        fix="remove the SET options (or ODBC DSN settings) that change them; "
        "the ODBC driver's defaults are right",
        details=wrong,
    )


#: The checks this database adds to ``outbox doctor``, by finding name.
CHECKS = [
    ("isolation", isolation),
    ("lock_escalation", lock_escalation),
    ("set_options", set_options),
]

DOCTOR = FamilyDoctor(
    checks=CHECKS,
    locking="claims skip each other's rows with READPAST",
    upgrade_hint="upgrade to SQL Server 2016 (13.0) or newer",
)
