"""The checks of ``outbox doctor`` every database shares, and the runner.

Each database adds its own (isolation, vacuum, storage engine, journal mode)
through the ``DOCTOR`` of ``outbox_core/dialects/<name>/doctor.py`` (``doctor.family``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.schema import AddConstraint, CreateIndex, DropIndex

from outbox_core.dialects.base.adoption import guess_columns
from outbox_core.dialects.base.values import aware
from outbox_core.doctor.family import Check, family_doctor
from outbox_core.doctor.model import (
    DEAD_TUPLE_RATIO,
    LONG_TRANSACTION,
    MAX_BACKLOG_AGE,
    MIN_DEAD_TUPLES,
    DoctorContext,
    Finding,
    Severity,
    Thresholds,
    error_text,
    format_age,
)
from outbox_core.errors import AdoptionRefused, OutboxError, UnsupportedDatabase
from outbox_core.redaction import mask_url
from outbox_core.schema import detached_index, missing_columns, obsolete_indexes

if TYPE_CHECKING:
    from outbox_core.outbox import Outbox

#: One check: findings from an open context.


def diagnose(
    outbox: Outbox,
    *,
    max_backlog_age: float = MAX_BACKLOG_AGE,
    long_transaction: float = LONG_TRANSACTION,
    dead_tuple_ratio: float = DEAD_TUPLE_RATIO,
    min_dead_tuples: int = MIN_DEAD_TUPLES,
) -> list[Finding]:
    """Check ``outbox``'s database and tables; return every finding, worst first.

    Thresholds: ``max_backlog_age`` seconds the oldest due event may wait,
    ``long_transaction`` seconds before an open transaction is reported
    (PostgreSQL, MySQL/MariaDB), and dead row versions above ``dead_tuple_ratio`` x live rows
    (and at least ``min_dead_tuples``). Nothing is written to the database.
    """
    limits = Thresholds(max_backlog_age, long_transaction, dead_tuple_ratio, min_dead_tuples)
    family = family_doctor(outbox.dialect)
    if family.preflight is not None:
        missing = family.preflight(outbox.url, DoctorContext.install_command_for(outbox))
        if missing is not None:
            return [missing]
    try:
        conn = outbox.engine.connect()
    except (sa.exc.SQLAlchemyError, OutboxError) as exc:
        url = mask_url(outbox.url)
        return [
            Finding(
                "connection",
                Severity.ERROR,
                f"cannot connect to {url}: {error_text(exc)}",
                fix="check the URL, the credentials, that the server runs and is reachable "
                "from here, and that the driver is installed",
            )
        ]
    findings: list[Finding] = []
    with conn:
        ctx = DoctorContext(outbox, conn, limits)
        checks: list[tuple[str, Check]] = [
            ("version", _check_version),
            ("tables", _check_tables),
            ("index", _check_indexes),
            *family.checks,  # isolation, WAL, vacuum, engines, ...
            ("backlog", _check_backlog),
            ("dead_events", _check_dead_events),
        ]
        for name, check in checks:
            if name == "backlog" and any(f.check == "backlog" for f in findings):
                continue  # the family's own stands (log tailing: the stream, not the rows)
            findings.extend(_run(ctx, name, check))
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.OK: 2}
    return sorted(findings, key=lambda f: order[f.severity])


def _run(ctx: DoctorContext, name: str, check: Check) -> list[Finding]:
    """Run one check in its own read transaction; a failure is reported, not raised."""
    try:
        return list(check(ctx))
    except (sa.exc.SQLAlchemyError, OutboxError) as exc:
        return [
            Finding(
                name,
                Severity.WARNING,
                f"the check could not run: {error_text(exc)}",
                fix="run the doctor as a user that can read the outbox tables and the "
                "server's catalog views",
            )
        ]
    finally:
        # End the check's transaction: the doctor must not hold a snapshot
        # (it would be a long transaction itself) or a failed one (PostgreSQL).
        with contextlib.suppress(sa.exc.SQLAlchemyError):
            ctx.conn.rollback()


def _check_version(ctx: DoctorContext) -> Iterable[Finding]:
    label = ctx.outbox.dialect.server_info(ctx.conn).label
    try:
        ctx.outbox.dialect.check(ctx.conn)
    except UnsupportedDatabase as exc:
        yield Finding(
            "version",
            Severity.ERROR,
            str(exc),
            fix=family_doctor(ctx.outbox.dialect).upgrade_hint,
            details={"server": label},
        )
        return
    yield Finding(
        "version",
        Severity.OK,
        f"{label}: {family_doctor(ctx.outbox.dialect).locking}",
        details={"server": label},
    )


def _check_tables(ctx: DoctorContext) -> Iterable[Finding]:
    inspector = sa.inspect(ctx.conn)
    for key, table in ctx.tables():
        if inspector.has_table(table.name, schema=table.schema):
            ctx.present.add(key)
            continue
        if key == "outbox":
            yield Finding(
                "tables",
                Severity.ERROR,
                f"the outbox table {table.fullname} does not exist",
                fix=ctx.install_command(),
            )
        else:
            yield Finding(
                "tables",
                Severity.WARNING,
                f"the inbox table {table.fullname} does not exist: Inbox.record fails "
                "until it does (ignore this if no consumer uses the inbox here)",
                fix=f"{ctx.install_command()}  (creates only what is missing)",
            )
    if "outbox" in ctx.present:
        yield from _missing_columns(ctx, inspector)
    relays = ctx.outbox.tables.relays
    if not inspector.has_table(relays.name, schema=relays.schema):
        yield Finding(
            "tables",
            Severity.WARNING,
            f"the relay membership table {relays.fullname} does not exist: ordered "
            "relays cannot start until it does",
            fix=f"{ctx.install_command()}  (creates only what is missing)",
        )
    presence = ctx.outbox.tables.presence
    if not inspector.has_table(presence.name, schema=presence.schema):
        yield Finding(
            "tables",
            Severity.WARNING,
            f"the presence table {presence.fullname} does not exist: relays run, but the "
            "dashboard and outbox status cannot list them",
            fix=f"{ctx.install_command()}  (creates only what is missing)",
        )
    if "inbox" in ctx.present:
        yield from _inbox_primary_key(ctx, inspector)
    if ctx.present == {"outbox", "inbox"}:
        names = ", ".join(t.fullname for _, t in ctx.tables())
        yield Finding("tables", Severity.OK, f"tables {names} exist")


def _missing_columns(ctx: DoctorContext, inspector: sa.Inspector) -> Iterable[Finding]:
    table = ctx.outbox.tables.outbox
    dialect = ctx.outbox.dialect
    if ctx.outbox.tables.adopted:
        yield from _adoption(ctx)
        return
    foreign = dialect.adoption.foreign_columns(ctx.conn)
    if foreign:
        # Another layout (Debezium's, say): plain `install` would fail; the
        # checks that read the table would fail on its columns too.
        ctx.present.discard("outbox")
        guess = guess_columns(dialect.adoption.present_columns(ctx.conn))
        yield Finding(
            "tables",
            Severity.ERROR,
            f"the table {table.fullname} is in another layout (no column(s) "
            f"{', '.join(foreign)}): relay it as it is by naming its columns with --columns "
            "(on every outbox command, or columns in outbox.toml)"
            + ("" if guess is not None else ": its event id, topic and payload columns"),
            fix=(
                f"{ctx.install_command()} --columns {guess}  (adds only the toolkit's "
                "bookkeeping columns; add --existing sent if every row was published already)"
                if guess is not None
                else f"{ctx.install_command()} --columns event_id=COLUMN,topic=COLUMN,"
                "payload=COLUMN,key=COLUMN"
            ),
            details={"missing_columns": foreign, "columns": str(guess) if guess else None},
        )
        return
    present = {c["name"].lower() for c in inspector.get_columns(table.name, schema=table.schema)}
    missing = [c.name for c in missing_columns(table, present)]
    if missing:
        yield Finding(
            "tables",
            Severity.ERROR,
            f"the outbox table {table.fullname} lacks the column(s) {', '.join(missing)} "
            "this version writes: enqueue fails until they are added",
            fix=f"{ctx.install_command()}  (adds the missing columns; existing rows stay)",
            details={"missing_columns": missing},
        )


def _adoption(ctx: DoctorContext) -> Iterable[Finding]:
    """An adopted table (``--columns``): what ``install`` would still add, or why it cannot."""
    dialect = ctx.outbox.dialect
    table = ctx.outbox.tables.outbox
    try:
        plan = dialect.adoption.plan(ctx.conn, partial_indexes=dialect.partial_indexes)
    except AdoptionRefused as exc:
        ctx.present.discard("outbox")
        yield Finding("tables", Severity.ERROR, str(exc), fix="fix the table, or --columns")
        return
    added = [name for name, _ in plan.columns]
    if added:
        ctx.present.discard("outbox")
        yield Finding(
            "tables",
            Severity.ERROR,
            f"the table {table.fullname} ({ctx.outbox.tables.columns}) lacks the toolkit's "
            f"bookkeeping column(s) {', '.join(added)}: relays cannot claim its rows",
            fix=f"{ctx.install_command()}  (adds only those, with defaults; existing rows stay)",
            details={"missing_columns": added},
        )
        return
    unfilled = dialect.adoption.unfilled_columns(ctx.conn)
    if unfilled:
        yield Finding(
            "tables",
            Severity.WARNING,
            f"the table {table.fullname} has NOT NULL column(s) {', '.join(unfilled)} without "
            "a default: your INSERTs fill them, but enqueue() cannot, nor can log tailing "
            "write back a row you deleted in its own transaction (a retry or a dead event)",
            fix=f"give them defaults (ALTER TABLE {table.name} ALTER ... SET DEFAULT ...) or "
            "allow NULL, or keep writing with your own INSERTs and keep the rows",
            details={"unfilled_columns": unfilled},
        )


def _inbox_primary_key(ctx: DoctorContext, inspector: sa.Inspector) -> Iterable[Finding]:
    table = ctx.outbox.tables.inbox
    found = inspector.get_pk_constraint(table.name, schema=table.schema)
    columns = [str(c).lower() for c in found.get("constrained_columns") or []]
    if columns == ["consumer", "event_id"]:
        return
    if not family_doctor(ctx.outbox.dialect).can_add_primary_key:
        fix = (
            f"SQLite cannot add a primary key: drop {table.fullname} (its rows only "
            f"deduplicate past deliveries) and run {ctx.install_command()}"
        )
    else:
        ddl = AddConstraint(table.primary_key).compile(dialect=ctx.conn.dialect)
        fix = str(ddl).strip() + ";"
    yield Finding(
        "tables",
        Severity.ERROR,
        f"the inbox table {table.fullname} has primary key {columns or 'none'} instead of "
        "(consumer, event_id): duplicates are not detected",
        fix=fix,
        details={"primary_key": columns},
    )


#: Why each index of schema.py matters, by its name's ending.
_INDEX_PURPOSE = {
    "_state_id": "claims read pending rows in id order through it",
    "_state_key_id": "ordered claims: the walk over keys with pending rows and the "
    "head-of-key check",
    "_event_id": "event ids must stay unique",
    "_pending": "claims read pending rows in id order through it (sent rows are not in it)",
    "_pending_key": "ordered claims: the walk over keys with pending rows and each key's run",
    "_leased": "the head-of-key check and the reaper read leased rows through it",
    "_dead": "the head-of-key check, replay and status read dead rows through it",
    "_processed_at": "inbox cleanup by age",
}


def _purpose(name: str) -> str:
    for ending, purpose in sorted(_INDEX_PURPOSE.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(ending):
            return purpose
    return "part of the outbox schema"


def expected_indexes(outbox: Outbox, dialect: sa.Dialect) -> dict[str, str]:
    """Index name -> its ``CREATE INDEX`` for ``dialect``, as ``outbox install`` creates them.

    Built by running the schema's ``create_all`` against a mock engine, so
    indexes limited to some databases (the partial pending index) are only
    expected where they exist.
    """
    ddl: dict[str, str] = {}

    def record(element: sa.schema.ExecutableDDLElement, *_: object, **__: object) -> None:
        if isinstance(element, CreateIndex):
            index = element.element
            ddl[str(index.name)] = str(element.compile(dialect=dialect)).strip() + ";"

    mock = sa.create_mock_engine(sa.engine.URL.create(outbox.url.drivername), record)
    tables = outbox.tables
    tables.metadata.create_all(mock, tables=tables.all, checkfirst=False)
    return ddl


def _check_indexes(ctx: DoctorContext) -> Iterable[Finding]:
    inspector = sa.inspect(ctx.conn)
    wanted = expected_indexes(ctx.outbox, ctx.conn.dialect)
    problems = 0
    for key, table in ctx.tables():
        if key not in ctx.present:
            continue
        reflected = inspector.get_indexes(table.name, schema=table.schema)
        names = {str(ix["name"]) for ix in reflected}
        found = [
            (
                tuple(str(c).lower() for c in ix.get("column_names") or [] if c is not None),
                bool(ix.get("unique")),
            )
            for ix in reflected
        ]
        # A primary key is a unique index too (an adopted table's event id is often its key).
        key_columns = inspector.get_pk_constraint(table.name, schema=table.schema)
        found.append(
            (tuple(str(c).lower() for c in key_columns.get("constrained_columns") or []), True)
        )
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            name = str(index.name)
            if name not in wanted or name in names:
                continue  # not created on this database, or present
            columns = tuple(c.name.lower() for c in index.columns)
            # A full index of your own on the same columns serves as well; a
            # partial one is matched by name only (its predicate is the point).
            partial = "WHERE" in wanted[name]
            if not partial and any(
                cols == columns and (unique or not index.unique) for cols, unique in found
            ):
                continue
            problems += 1
            yield Finding(
                "index",
                Severity.ERROR if key == "outbox" else Severity.WARNING,
                f"missing {'unique ' if index.unique else ''}index {name} on "
                f"{table.fullname} ({', '.join(columns)}): {_purpose(name)}; "
                "`outbox install` creates it",
                fix=wanted[name],
                details={"table": table.fullname, "index": name, "columns": list(columns)},
            )
        if key == "outbox":
            dialect = ctx.outbox.dialect
            for name in obsolete_indexes(table, dialect.partial_indexes):
                if name not in names:
                    continue
                problems += 1
                index = detached_index(table, name)
                drop = str(DropIndex(index).compile(dialect=ctx.conn.dialect))
                yield Finding(
                    "index",
                    Severity.WARNING,
                    f"obsolete index {name} on {table.fullname}: this version does not read "
                    "it, yet every claim and every settle writes it; `outbox install` drops "
                    "it once its replacements exist",
                    fix=drop.strip() + ";",
                    details={"table": table.fullname, "index": name, "obsolete": True},
                )
    if ctx.present and not problems:
        yield Finding("index", Severity.OK, f"all {len(wanted)} expected indexes are present")


def _check_backlog(ctx: DoctorContext) -> Iterable[Finding]:
    if "outbox" not in ctx.present:
        return
    backlog = ctx.outbox.dialect.reads.backlog(ctx.conn)
    pending_n, due_n, oldest_due = backlog.pending, backlog.due, backlog.oldest_due
    expired, db_now = backlog.expired_leases, backlog.now
    waited = None
    if oldest_due is not None:
        waited = max(0.0, (aware(db_now) - aware(oldest_due)).total_seconds())
    details = {
        "pending": int(pending_n),
        "due": int(due_n),
        "oldest_due_age": waited,
        "expired_leases": int(expired),
    }
    leases = (
        f"; {expired} expired lease(s): a relay died mid-batch, a running relay returns them"
        if expired
        else ""
    )
    limit = ctx.limits.max_backlog_age
    if waited is not None and waited > limit:
        yield Finding(
            "backlog",
            Severity.WARNING,
            f"the oldest due event has waited {format_age(waited)} for a relay (threshold "
            f"{format_age(limit)}); {due_n} due of {pending_n} pending{leases}",
            fix="start a relay (outbox relay) or check its logs for errors; if relays run "
            "and cannot keep up, add relays or raise --batch-size",
            details=details,
        )
        return
    age = "nothing due" if waited is None else f"oldest due waited {format_age(waited)}"
    yield Finding(
        "backlog",
        Severity.OK,
        f"{pending_n} pending, {age} (threshold {format_age(limit)}){leases}",
        details=details,
    )


def _check_dead_events(ctx: DoctorContext) -> Iterable[Finding]:
    if "outbox" not in ctx.present:
        return
    rows = ctx.outbox.dialect.reads.dead_by_topic(ctx.conn)
    if not rows:
        yield Finding("dead_events", Severity.OK, "no dead events")
        return
    total = sum(int(r[1]) for r in rows)
    topics = [
        {"topic": topic, "count": int(n), "last_error": (error or "").strip()[:200] or None}
        for topic, n, error in rows
    ]
    described = "; ".join(
        f"{d['topic']}: {d['count']}"
        + (f" (last error: {str(d['last_error']).splitlines()[0][:80]})" if d["last_error"] else "")
        for d in topics[:10]
    )
    first = topics[0]["topic"]
    yield Finding(
        "dead_events",
        Severity.WARNING,
        f"{total} dead event(s) are not being published: {described}",
        fix=f"fix the cause named by last_error (outbox status shows it), then replay: "
        f"outbox replay --topic {first} (or --all); dead events are kept, never cleaned up",
        details={"dead": total, "topics": topics},
    )
