"""``outbox doctor --source binlog``: the server's binlog settings, the source's position
still in the binlog, its reader, and what waits in the stream.

Called from ``outbox_core.dialects.mysql.doctor`` only with ``--source binlog``
(this package needs the ``binlog`` extra). Every check is a finding named
``log_tailing``, and ``backlog`` stands instead of the table's: rows stay
pending in this mode, so their age says nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from outbox_core.dialects.base.tailing.diagnosis import StreamWords
from outbox_core.dialects.mysql.binlog.names import source_name
from outbox_core.dialects.mysql.binlog.server import (
    BinlogServer,
    lock_holder,
    purged_past,
    read_server,
    retention,
)
from outbox_core.dialects.mysql.binlog.source import BinlogSource
from outbox_core.dialects.mysql.binlog.table import BinlogTable
from outbox_core.dialects.mysql.binlog.tailing import current_schema
from outbox_core.doctor.model import DoctorContext, Finding, Severity, format_age
from outbox_core.relay.tailing import TailingStatus

CHECK = "log_tailing"


def server_findings(server: BinlogServer) -> list[Finding]:
    """One error per setting or privilege that keeps the binlog from being tailed."""
    found = []
    for problem in server.problems():
        what, _, how = problem.partition(": ")
        found.append(
            Finding(
                CHECK,
                Severity.ERROR,
                f"the binlog cannot be tailed: {what}",
                fix=how or None,
                details={"settings": server.settings},
            )
        )
    return found


def log_tailing(ctx: DoctorContext) -> Iterable[Finding]:
    """The server's settings, the source's position (installed, not purged), its reader."""
    conn, outbox = ctx.conn, ctx.outbox
    name = source_name(outbox.settings)
    server = read_server(conn)
    problems = server_findings(server)
    yield from problems
    table = BinlogTable(outbox.dialect)
    if not sa.inspect(conn).has_table(table.table.name, schema=table.table.schema):
        return  # the tables check says so, with the install command
    missing = table.missing(conn)
    settled = None if missing else table.progress.settled(conn, name)
    if settled is None:
        yield Finding(
            CHECK,
            Severity.ERROR,
            f"source is binlog but {name!r} has no position"
            + (f" ({', '.join(missing)} missing)" if missing else ""),
            fix=f"{ctx.install_command()} --source binlog",
        )
        return
    details: dict[str, Any] = {
        "source": name,
        "confirmed": server.describe(settled),
        "binlog_end": server.describe(server.end),
        "behind_transactions": server.count(server.end) - server.count(settled),
    }
    why = purged_past(conn, server, settled)
    if why is not None:
        yield Finding(
            CHECK,
            Severity.ERROR,
            why,
            fix="stop the binlog relays; `outbox install --source binlog` (the source starts "
            "at the binlog's end); `outbox relay --source table` until nothing is pending "
            "(it sends again every row still in the table); then `outbox relay --source "
            "binlog` (docs: Log tailing, MySQL and MariaDB)",
            details=details,
        )
        return
    if not problems:
        yield _reader(ctx, server, name, details)


def _reader(
    ctx: DoctorContext, server: BinlogServer, name: str, details: dict[str, Any]
) -> Finding:
    """A source whose position is in the binlog: whether a relay reads it, and the binlog kept."""
    kept = retention(ctx.conn)
    holder = lock_holder(ctx.conn, _source(ctx, name).lock_id)
    details |= {
        "reader_connection": holder,
        "retained_bytes": kept.bytes,
        "binlog_files": kept.files,
        "binlog_expire_seconds": kept.expire_seconds,
    }
    behind = details["behind_transactions"]
    summary = (
        f"confirmed {details['confirmed']} ({behind} transaction(s) behind the binlog's end "
        f"{details['binlog_end']}); the server keeps {kept.bytes / 2**20:.1f} MiB of binlog "
        f"in {kept.files} file(s)"
    )
    expiry = (
        f"binlogs expire after {format_age(kept.expire_seconds)}"
        if kept.expire_seconds
        else "binlogs never expire by age"
    )
    if holder is None:
        return Finding(
            CHECK,
            Severity.WARNING,
            f"no relay reads binlog source {name!r}: {summary}; {expiry}, and once the "
            "binlog holding its position is purged the relay refuses to start",
            fix="start a relay: outbox relay --source binlog",
            details=details,
        )
    return Finding(
        CHECK,
        Severity.OK,
        f"binlog source {name!r} is read (connection {holder}): {summary}; {expiry}",
        details=details,
    )


def _source(ctx: DoctorContext, name: str) -> BinlogSource:
    outbox = ctx.outbox
    return BinlogSource(
        outbox.engine, outbox.dialect, name=name, schema=current_schema(ctx.conn, outbox),
        relay="doctor", table=BinlogTable(outbox.dialect),
    )  # fmt: skip


def stream_backlog(ctx: DoctorContext) -> Iterable[Finding]:
    """What waits in the stream (held, unread, deferred past due), instead of the table's
    pending rows: a warning when the oldest has waited longer than ``max_backlog_age``."""
    conn = ctx.conn
    name = source_name(ctx.outbox.settings)
    source = _source(ctx, name)
    found = sa.inspect(conn).has_table(source.table.table.name, schema=source.table.table.schema)
    if not found or source.table.missing(conn):
        return  # log_tailing says what to install
    server = read_server(conn)
    status = source.table.source_status(conn, name, source.facts(conn), server.describe)
    if not status.exists:
        return
    yield BINLOG_STREAM.backlog(status, name, ctx.limits.max_backlog_age)


def _summary(status: TailingStatus) -> str:
    """Held and published by the reading relay, or its last report's age; deferred rows."""
    if status.reading:
        rate = (status.published_last_minute or 0) / 60
        parts = [f"{status.held} held by relay {status.relay}", f"{rate:.1f}/s published"]
    else:
        ago = format_age(status.report_age or 0.0)
        parts = [f"no relay reads (relay {status.relay} last reported {ago} ago)"]
    if status.deferred:
        parts.append(f"{status.deferred} deferred in the table")
    return ", ".join(parts)


#: How this doctor speaks of a binlog source's stream.
BINLOG_STREAM = StreamWords(
    kind="binlog",
    called="binlog source",
    key="source",
    summary=_summary,
    unknown="what waits is unknown",
    holds="an outage holds events",
)
