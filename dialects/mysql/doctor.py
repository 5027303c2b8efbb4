"""MySQL/MariaDB diagnostics of ``outbox doctor``: isolation, binlog, engines, long transactions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from outbox_core.doctor.family import FamilyDoctor
from outbox_core.doctor.model import DoctorContext, Finding, Severity, format_age


def isolation(ctx: DoctorContext) -> Iterable[Finding]:
    """The server default against the READ COMMITTED relays set; binlog formats that refuse it."""
    # SHOW has no Core construct; the variable names differ between MySQL 8
    # (transaction_isolation) and MariaDB before 11.1 (tx_isolation).
    rows = ctx.conn.execute(
        sa.text(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN "
            "('transaction_isolation', 'tx_isolation', 'log_bin', 'binlog_format')"
        )
    ).all()
    variables = {str(name).lower(): str(value) for name, value in rows}
    server_default = variables.get("transaction_isolation") or variables.get("tx_isolation", "?")
    ctx.conn.rollback()
    dialect = ctx.outbox.dialect
    relay_conn = ctx.outbox.engine.connect()
    try:
        dialect.session.prepare(relay_conn)
        relay_level = str(relay_conn.get_isolation_level())
    finally:
        relay_conn.close()
    details = {
        "server_default": server_default,
        "relay": relay_level,
        "log_bin": variables.get("log_bin"),
        "binlog_format": variables.get("binlog_format"),
    }
    if relay_level.replace("-", " ").upper() != "READ COMMITTED":
        yield Finding(
            "isolation",
            Severity.ERROR,
            f"the relay's connections should claim at READ COMMITTED but run at {relay_level}",
            fix="check that nothing (init_command, a proxy) overrides the session's "
            "transaction isolation",
            details=details,
        )
        return
    if variables.get("log_bin", "").upper() == "ON" and (
        variables.get("binlog_format", "").upper() == "STATEMENT"
    ):
        yield Finding(
            "isolation",
            Severity.ERROR,
            "binary logging with binlog_format=STATEMENT: InnoDB refuses writes at READ "
            "COMMITTED in that format, so every claim fails",
            fix="SET GLOBAL binlog_format = 'ROW'; and binlog_format=ROW (or MIXED) in the "
            "server's configuration file",
            details=details,
        )
        return
    yield Finding(
        "isolation",
        Severity.OK,
        f"server default {server_default}; the relay sets READ COMMITTED on each of its "
        "connections (checked), so its claims take no gap locks that would block your "
        "inserts; your own transactions keep the server default",
        details=details,
    )


def engines(ctx: DoctorContext) -> Iterable[Finding]:
    """The outbox tables must be InnoDB (transactions and row locks)."""
    # information_schema names are case-insensitive: lower case needs no quoting.
    info = sa.table(
        "tables",
        sa.column("table_schema"),
        sa.column("table_name"),
        sa.column("engine"),
        schema="information_schema",
    )
    wanted = {t.name: t for key, t in ctx.tables() if key in ctx.present}
    schema: Any = ctx.outbox.table.schema or sa.func.database()
    rows = ctx.conn.execute(
        sa.select(info.c.table_name, info.c.engine).where(
            info.c.table_schema == schema,
            info.c.table_name.in_(list(wanted)),
        )
    ).all()
    for name, engine in rows:
        table = wanted.get(str(name))
        if table is not None and str(engine).lower() != "innodb":
            yield Finding(
                "tables",
                Severity.ERROR,
                f"{table.fullname} uses the {engine} storage engine: without InnoDB there are "
                "no transactions or row locks, so events are not atomic with your writes "
                "and claims overlap",
                fix=f"ALTER TABLE {ctx.quoted(table)} ENGINE=InnoDB;",
                details={"engine": engine},
            )


def long_transactions(ctx: DoctorContext) -> Iterable[Finding]:
    """Long InnoDB transactions, which hold back purge."""
    trx = sa.table(
        "innodb_trx",
        sa.column("trx_id"),
        sa.column("trx_state"),
        sa.column("trx_started"),
        sa.column("trx_mysql_thread_id"),
        sa.column("trx_rows_locked"),
        sa.column("trx_query"),
        schema="information_schema",
    )
    # trx_started and NOW() are both in the session's time zone.
    age = sa.func.timestampdiff(sa.literal_column("SECOND"), trx.c.trx_started, sa.func.now())
    rows = ctx.conn.execute(
        sa.select(
            trx.c.trx_mysql_thread_id,
            trx.c.trx_state,
            age,
            trx.c.trx_rows_locked,
            sa.func.left(trx.c.trx_query, 100),
        )
        .where(
            trx.c.trx_mysql_thread_id != sa.func.connection_id(),
            age > ctx.limits.long_transaction,
        )
        .order_by(trx.c.trx_started)
    ).all()
    threshold = format_age(ctx.limits.long_transaction)
    if not rows:
        yield Finding(
            "long_transactions",
            Severity.OK,
            f"no InnoDB transaction has been open longer than {threshold}",
        )
        return
    found = [
        {
            "thread_id": int(thread),
            "state": state,
            "seconds": float(seconds),
            "rows_locked": int(locked or 0),
            "query": " ".join(str(text or "").split()),
        }
        for thread, state, seconds, locked, text in rows
    ]
    lines = [
        f"thread {f['thread_id']} ({f['state']}, {f['rows_locked']} rows locked) open for "
        f"{format_age(float(f['seconds']))}"
        for f in found
    ]
    kill = " ".join(f"KILL {f['thread_id']};" for f in found)
    yield Finding(
        "long_transactions",
        Severity.WARNING,
        f"{len(rows)} transaction(s) open longer than {threshold}: purge cannot remove old "
        "row versions while they run, and the rows they lock stall claims and producers: "
        + "; ".join(lines),
        fix=f"end them in the application (commit or roll back), or: {kill}",
        details={"transactions": found},
    )


def binlog(ctx: DoctorContext) -> Iterable[Finding]:
    """``--source binlog``: the server's binlog settings, the source's position still in the
    binlog (an error once purged past it), its reader and the binlog kept."""
    if ctx.outbox.settings.source != "binlog":
        return []  # nothing to tail; the binlog extra may not even be installed
    from outbox_core.dialects.mysql.binlog.diagnosis import log_tailing

    return log_tailing(ctx)


def binlog_backlog(ctx: DoctorContext) -> Iterable[Finding]:
    """``--source binlog``: what waits in the stream, instead of the table's pending rows
    (which stay pending once published in this mode)."""
    if ctx.outbox.settings.source != "binlog":
        return []
    from outbox_core.dialects.mysql.binlog.diagnosis import stream_backlog

    return stream_backlog(ctx)


#: The checks this database adds to ``outbox doctor``, by finding name.
CHECKS = [
    ("isolation", isolation),
    ("tables", engines),
    ("long_transactions", long_transactions),
    ("log_tailing", binlog),
    # Log tailing: stands instead of the table's backlog check.
    ("backlog", binlog_backlog),
]

DOCTOR = FamilyDoctor(
    checks=CHECKS,
    locking="claims skip each other's rows with FOR UPDATE SKIP LOCKED",
    upgrade_hint=("upgrade to MySQL 8.0.1+ or MariaDB 10.6+ (the first with SKIP LOCKED)"),
)
