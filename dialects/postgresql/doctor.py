"""PostgreSQL diagnostics of ``outbox doctor``: isolation, dead row versions, long transactions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from outbox_core.dialects.base.tailing.diagnosis import StreamWords
from outbox_core.doctor.family import FamilyDoctor
from outbox_core.doctor.model import DoctorContext, Finding, Severity, format_age

if TYPE_CHECKING:
    from outbox_core.dialects.postgresql.wal import SlotFacts
    from outbox_core.relay.tailing import TailingStatus


def isolation(ctx: DoctorContext) -> Iterable[Finding]:
    """The default isolation level claims and settles run at."""
    level, database = ctx.conn.execute(
        sa.select(
            sa.func.current_setting("default_transaction_isolation", type_=sa.String()),
            sa.func.current_database(type_=sa.String()),
        )
    ).one()
    details = {"default_transaction_isolation": level}
    if level == "read committed":
        yield Finding(
            "isolation",
            Severity.OK,
            "claims run at READ COMMITTED (the server default), "
            "which FOR UPDATE SKIP LOCKED claims are built for",
            details=details,
        )
        return
    db = ctx.conn.dialect.identifier_preparer.quote(database)
    yield Finding(
        "isolation",
        Severity.WARNING,
        f"default_transaction_isolation is '{level}': the relay's claims and settles run at "
        "it and fail with serialization errors under concurrency (the relay retries them, "
        "slowly)",
        fix=f"ALTER DATABASE {db} SET default_transaction_isolation = 'read committed'; "
        "(or ALTER ROLE <relay user> SET ...), then restart the relays",
        details=details,
    )


def dead_tuples(ctx: DoctorContext) -> Iterable[Finding]:
    """Dead row versions of the outbox tables and when they were last vacuumed."""
    stats = sa.table(
        "pg_stat_user_tables",
        sa.column("schemaname"),
        sa.column("relname"),
        sa.column("n_live_tup"),
        sa.column("n_dead_tup"),
        sa.column("last_autovacuum"),
        sa.column("last_vacuum"),
        schema="pg_catalog",
    )
    limits = ctx.limits
    for key, table in ctx.tables():
        if key not in ctx.present:
            continue
        schema: Any = table.schema if table.schema else sa.func.current_schema()
        row = ctx.conn.execute(
            sa.select(
                stats.c.n_live_tup,
                stats.c.n_dead_tup,
                sa.func.greatest(stats.c.last_autovacuum, stats.c.last_vacuum),
                sa.func.now(),
            ).where(stats.c.relname == table.name, stats.c.schemaname == schema)
        ).one_or_none()
        if row is None:
            continue
        live, dead, vacuumed, now = int(row[0] or 0), int(row[1] or 0), row[2], row[3]
        last = (
            "never" if vacuumed is None else f"{format_age((now - vacuumed).total_seconds())} ago"
        )
        details = {"table": table.fullname, "live": live, "dead": dead, "last_vacuum": last}
        summary = f"{table.fullname}: {dead} dead row versions, {live} live (last vacuum: {last})"
        if dead >= limits.min_dead_tuples and dead > limits.dead_tuple_ratio * max(live, 1):
            name = ctx.quoted(table)
            yield Finding(
                "dead_tuples",
                Severity.WARNING,
                f"{summary}: every claim and settle leaves one behind, and until vacuum "
                "removes them claims scan them too",
                fix=f"VACUUM (ANALYZE) {name}; let autovacuum visit it sooner: ALTER TABLE "
                f"{name} SET (autovacuum_vacuum_scale_factor = 0.01, "
                "autovacuum_vacuum_threshold = 1000); a long transaction (see below) keeps "
                "vacuum from removing them",
                details=details,
            )
        else:
            yield Finding("dead_tuples", Severity.OK, summary, details=details)


def long_transactions(ctx: DoctorContext) -> Iterable[Finding]:
    """Open transactions that keep vacuum from removing dead row versions."""
    activity = sa.table(
        "pg_stat_activity",
        sa.column("pid"),
        sa.column("datname"),
        sa.column("usename"),
        sa.column("application_name"),
        sa.column("backend_type"),
        sa.column("state"),
        sa.column("xact_start"),
        sa.column("backend_xmin"),
        sa.column("backend_xid"),
        sa.column("query"),
        schema="pg_catalog",
    )
    # clock_timestamp(): now() would be the start of the doctor's own transaction.
    age = sa.extract("epoch", sa.func.clock_timestamp() - activity.c.xact_start)
    rows = ctx.conn.execute(
        sa.select(
            activity.c.pid,
            activity.c.usename,
            activity.c.application_name,
            activity.c.state,
            age,
            activity.c.backend_xmin,
            activity.c.backend_xid,
            sa.func.left(activity.c.query, 100),
        )
        .where(
            activity.c.datname == sa.func.current_database(),
            activity.c.backend_type == "client backend",
            activity.c.pid != sa.func.pg_backend_pid(),
            activity.c.xact_start.is_not(None),
            age > ctx.limits.long_transaction,
        )
        .order_by(activity.c.xact_start)
    ).all()
    threshold = format_age(ctx.limits.long_transaction)
    if not rows:
        yield Finding(
            "long_transactions",
            Severity.OK,
            f"no transaction in this database has been open longer than {threshold}",
        )
        return
    lines = []
    found = []
    for pid, user, app, state, seconds, xmin, xid, text in rows:
        query = " ".join(str(text or "").split())
        holds = xmin is not None or xid is not None
        found.append(
            {
                "pid": pid,
                "user": user,
                "application": app,
                "state": state,
                "seconds": float(seconds),
                "backend_xmin": None if xmin is None else str(xmin),
                "backend_xid": None if xid is None else str(xid),
                "holds_back_vacuum": holds,
                "query": query,
            }
        )
        lines.append(
            f"pid {pid} ({user}, {app or 'no application_name'}, {state}) open for "
            f"{format_age(float(seconds))}{', holds back vacuum' if holds else ''}: {query[:60]}"
        )
    kill = " ".join(f"SELECT pg_terminate_backend({f['pid']});" for f in found)
    database = ctx.conn.execute(sa.select(sa.func.current_database(type_=sa.String()))).scalar()
    db = ctx.conn.dialect.identifier_preparer.quote(str(database))
    yield Finding(
        "long_transactions",
        Severity.WARNING,
        f"{len(rows)} transaction(s) open longer than {threshold}; vacuum cannot remove row "
        "versions they might still see, so dead outbox rows pile up: " + "; ".join(lines),
        fix=f"end them in the application (commit or roll back), or: {kill} Prevent "
        f"forgotten ones: ALTER DATABASE {db} SET idle_in_transaction_session_timeout = '5min';",
        details={"transactions": found},
    )


def log_tailing(ctx: DoctorContext) -> Iterable[Finding]:
    """The replication slot of ``--source wal``: ready, read, and how much WAL it keeps.

    An abandoned slot keeps every WAL segment since its position on the
    server's disk, until the disk is full: an error past
    ``slot_retained_error``.
    """
    from outbox_core.dialects.postgresql.wal import check_ready, slot_facts, wal_names

    settings = ctx.outbox.settings
    slot, publication = wal_names(settings)
    facts = slot_facts(ctx.conn, slot)
    if facts is None:
        yield _no_slot(ctx, slot)
        return
    details = {
        "slot": slot,
        "publication": publication,
        "active": facts.active,
        "active_pid": facts.active_pid,
        "retained_bytes": facts.retained_bytes,
        "wal_status": facts.wal_status,
        "safe_wal_size": facts.safe_wal_size,
    }
    table = ctx.outbox.table
    problems = check_ready(
        ctx.conn, slot=slot, publication=publication, table=(table.schema, table.name)
    )
    if problems:
        yield Finding(
            "log_tailing",
            Severity.ERROR,
            f"slot {slot!r} cannot be read: " + "; ".join(str(p) for p in problems),
            fix="see README, Log tailing (PostgreSQL); `outbox uninstall --source wal` drops "
            "a slot nobody will read",
            details=details,
        )
        return
    yield _retention(ctx, slot, facts, details)


def _no_slot(ctx: DoctorContext, slot: str) -> Finding:
    """No replication slot: an error where the outbox is set to tail the log."""
    if ctx.outbox.settings.source == "wal":
        return Finding(
            "log_tailing",
            Severity.ERROR,
            f"source is wal but replication slot {slot!r} does not exist",
            fix=f"{ctx.install_command()} --source wal",
        )
    return Finding("log_tailing", Severity.OK, f"no replication slot {slot!r}: relayed by polling")


def _retention(ctx: DoctorContext, slot: str, facts: SlotFacts, details: dict[str, Any]) -> Finding:
    """A readable slot: whether a relay reads it, and the WAL it keeps on the server's disk."""
    retained = facts.retained_bytes or 0
    kept = f"keeps {retained / 2**20:.1f} MiB of WAL"
    drop = (
        "start a relay with --source wal on it, or drop it if log tailing was given up: "
        "outbox uninstall --source wal"
    )
    limits = ctx.limits
    if retained >= limits.slot_retained_error:
        return Finding(
            "log_tailing",
            Severity.ERROR,
            f"slot {slot!r} {kept} (over {limits.slot_retained_error / 2**30:.0f} GiB): the "
            "server cannot remove it until a relay confirms past it, and the disk fills",
            fix=drop,
            details=details,
        )
    if not facts.active:
        return Finding(
            "log_tailing",
            Severity.WARNING,
            f"no relay reads slot {slot!r} now; it {kept}, more with every write",
            fix=drop,
            details=details,
        )
    if retained >= limits.slot_retained_warning:
        return Finding(
            "log_tailing",
            Severity.WARNING,
            f"slot {slot!r} is read (pid {facts.active_pid}) but {kept}: the relay is behind",
            fix="look at the relay's broker (outages hold the slot) and its logs",
            details=details,
        )
    return Finding(
        "log_tailing",
        Severity.OK,
        f"slot {slot!r} is read (pid {facts.active_pid}) and {kept}",
        details=details,
    )


def stream_backlog(ctx: DoctorContext) -> Iterable[Finding]:
    """``--source wal``: what waits in the stream, instead of the table's pending rows
    (:meth:`~outbox_core.dialects.base.tailing.diagnosis.StreamWords.backlog`), with the WAL
    the relay has not read. Nothing (the table's backlog check runs) when the source is
    the table.
    """
    from outbox_core.dialects.postgresql.wal import wal_names
    from outbox_core.dialects.postgresql.wal.table import WalTable

    settings = ctx.outbox.settings
    if settings.source != "wal":
        return
    slot, _ = wal_names(settings)
    status = WalTable(ctx.outbox.dialect).slot_status(ctx.conn, slot)
    if not status.exists:
        yield Finding(
            "backlog",
            Severity.WARNING,
            f"what waits for log tailing is unknown: replication slot {slot!r} does not exist",
            fix=f"{ctx.install_command()} --source wal",
        )
        return
    yield SLOT_STREAM.backlog(
        status, slot, ctx.limits.max_backlog_age, unread_bytes=status.unread_bytes
    )


def _stream_summary(status: TailingStatus) -> str:
    """What the relay's last report says waits: held, published, unread, deferred."""
    parts = []
    if status.reading:
        parts.append(f"{status.held} held by relay {status.relay}")
        rate = (status.published_last_minute or 0) / 60
        parts.append(f"{rate:.1f}/s published over the last minute")
    else:
        ago = format_age(status.report_age or 0.0)
        parts.append(f"no relay reads (relay {status.relay} last reported {ago} ago)")
    if status.unread_bytes is not None:
        parts.append(f"{status.unread_bytes / 1024:.1f} KiB of WAL unread")
    if status.deferred:
        parts.append(f"{status.deferred} deferred in the table")
    return ", ".join(parts)


#: How this doctor speaks of a replication slot's stream.
SLOT_STREAM = StreamWords(kind="wal", called="slot", key="slot", summary=_stream_summary)

#: The checks this database adds to ``outbox doctor``, by finding name.
CHECKS = [
    ("isolation", isolation),
    ("dead_tuples", dead_tuples),
    ("long_transactions", long_transactions),
    ("log_tailing", log_tailing),
    # Log tailing: stands instead of the table's backlog check.
    ("backlog", stream_backlog),
]

DOCTOR = FamilyDoctor(
    checks=CHECKS,
    locking="claims skip each other's rows with FOR UPDATE SKIP LOCKED",
    upgrade_hint="upgrade to PostgreSQL 12 or newer",
)
