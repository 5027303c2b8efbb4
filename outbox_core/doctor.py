"""``outbox doctor``: check a database's outbox set-up and explain how to fix each finding.

>>> findings = diagnose(Outbox("postgresql+psycopg://app@db/app"))
>>> print(render_report(findings))

Each check gives one or more :class:`Finding` with a severity (``ok``,
``warning``, ``error``), what was found, why it matters, and the fix
(``CREATE INDEX`` compiled for the database, the setting to change, the
command to run):

* ``connection``: the database answers;
* ``version``: server version and how claims skip each other's rows (SKIP
  LOCKED, READPAST, SQLite's single writer), via the dialect's own check;
* ``isolation``: the level claims run at (PostgreSQL's default; MySQL's
  server default versus the READ COMMITTED the relay sets per connection, and
  a binary log format that refuses it; SQL Server's READ_COMMITTED_SNAPSHOT);
* ``tables``: the outbox and inbox tables exist, on InnoDB for MySQL, with
  the inbox's primary key;
* ``index``: every index of ``outbox_core/schema.py`` is there, compared by
  column list;
* ``journal_mode``: SQLite runs in WAL mode;
* ``dead_tuples`` and ``long_transactions``: PostgreSQL's dead row versions
  and the open transactions that keep vacuum from removing them (MySQL and
  MariaDB: long InnoDB transactions, which hold back purge);
* ``backlog`` and ``dead_events``: how long the oldest due event has waited,
  and dead events per topic.

A check that cannot run (no permission on a catalog view) is a warning that
says so; it never stops the others. The command exits 0 when healthy, 1 on an
error (or a warning with ``--strict``), 2 when its own arguments are wrong.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import click
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.schema import AddConstraint, CreateIndex

from outbox_core.clitools import DIALECT_NAMES, handle_errors
from outbox_core.config import load_settings, mask_url, parse_duration, redact
from outbox_core.errors import ConfigurationError, OutboxError, UnsupportedDatabase
from outbox_core.message import State
from outbox_core.outbox import Outbox

#: Defaults of the thresholds (seconds, ratio, rows).
MAX_BACKLOG_AGE = 300.0
LONG_TRANSACTION = 300.0
DEAD_TUPLE_RATIO = 0.2
MIN_DEAD_TUPLES = 10_000


class Severity(StrEnum):
    """How bad a finding is: ``ok``, ``warning`` (works, but watch it) or ``error``."""

    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Finding:
    """One result of the doctor: what was checked, what was found, and the fix."""

    check: str
    severity: Severity
    message: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "check": self.check,
            "severity": str(self.severity),
            "message": self.message,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass(frozen=True)
class Thresholds:
    """When a measurement becomes a warning."""

    #: Seconds the oldest due pending event may wait for a relay.
    max_backlog_age: float = MAX_BACKLOG_AGE
    #: Seconds a transaction may stay open (PostgreSQL, MySQL/MariaDB) before it is reported.
    long_transaction: float = LONG_TRANSACTION
    #: Dead row versions per live row above which a table needs vacuuming...
    dead_tuple_ratio: float = DEAD_TUPLE_RATIO
    #: ...once there are at least this many.
    min_dead_tuples: int = MIN_DEAD_TUPLES


@dataclass
class _Context:
    outbox: Outbox
    conn: Connection
    limits: Thresholds
    present: set[str] = field(default_factory=set)  # tables found, by key "outbox"/"inbox"

    @property
    def name(self) -> str:
        return self.outbox.dialect.name

    def quoted(self, table: sa.Table) -> str:
        """The table's name as the database wants it in DDL."""
        return self.conn.dialect.identifier_preparer.format_table(table)

    def install_command(self) -> str:
        return self.install_command_for(self.outbox)

    @staticmethod
    def install_command_for(outbox: Outbox) -> str:
        table = outbox.table
        url = mask_url(outbox.url.render_as_string(hide_password=False))
        args = f"outbox install --db '{url}'"
        args += f" --table {table.name}"
        if table.schema:
            args += f" --schema {table.schema}"
        return args


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
    missing = _missing_sqlite_file(outbox)
    if missing is not None:
        return [missing]
    try:
        conn = outbox.engine.connect()
    except (sa.exc.SQLAlchemyError, OutboxError) as exc:
        url = mask_url(outbox.url.render_as_string(hide_password=False))
        return [
            Finding(
                "connection",
                Severity.ERROR,
                f"cannot connect to {url}: {_error_text(exc)}",
                fix="check the URL, the credentials, that the server runs and is reachable "
                "from here, and that the driver is installed",
            )
        ]
    findings: list[Finding] = []
    with conn:
        ctx = _Context(outbox, conn, limits)
        checks: list[tuple[str, Callable[[_Context], Iterable[Finding]]]] = [
            ("version", _check_version),
            ("isolation", _check_isolation),
            ("tables", _check_tables),
            ("index", _check_indexes),
            ("journal_mode", _check_journal_mode),
            ("dead_tuples", _check_dead_tuples),
            ("long_transactions", _check_long_transactions),
            ("backlog", _check_backlog),
            ("dead_events", _check_dead_events),
        ]
        for name, check in checks:
            findings.extend(_run(ctx, name, check))
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.OK: 2}
    return sorted(findings, key=lambda f: order[f.severity])


def _missing_sqlite_file(outbox: Outbox) -> Finding | None:
    """Connecting would create a mistyped SQLite file: report it instead."""
    database = outbox.url.database
    if outbox.dialect.name != "sqlite" or not database or database == ":memory:":
        return None
    if database.startswith("file:") or Path(database).exists():
        return None
    return Finding(
        "connection",
        Severity.ERROR,
        f"the SQLite database file {database} does not exist",
        fix=f"check the path; {_Context.install_command_for(outbox)} creates it",
    )


def _run(ctx: _Context, name: str, check: Callable[[_Context], Iterable[Finding]]) -> list[Finding]:
    """Run one check in its own read transaction; a failure is reported, not raised."""
    try:
        return list(check(ctx))
    except (sa.exc.SQLAlchemyError, OutboxError) as exc:
        return [
            Finding(
                name,
                Severity.WARNING,
                f"the check could not run: {_error_text(exc)}",
                fix="run the doctor as a user that can read the outbox tables and the "
                "server's catalog views",
            )
        ]
    finally:
        # End the check's transaction: the doctor must not hold a snapshot
        # (it would be a long transaction itself) or a failed one (PostgreSQL).
        with contextlib.suppress(sa.exc.SQLAlchemyError):
            ctx.conn.rollback()


def _error_text(exc: BaseException) -> str:
    detail = getattr(exc, "orig", None) or exc
    return redact(str(detail).strip().splitlines()[0] if str(detail).strip() else repr(detail))


# -- version and capability -----------------------------------------------------------

_LOCKING = {
    "postgresql": "claims skip each other's rows with FOR UPDATE SKIP LOCKED",
    "mysql": "claims skip each other's rows with FOR UPDATE SKIP LOCKED",
    "mssql": "claims skip each other's rows with READPAST",
    "sqlite": "claims take turns on the database's write lock (BEGIN IMMEDIATE; SQLite has "
    "no row locks) and leases keep relays apart",
}
_UPGRADE = {
    "postgresql": "upgrade to PostgreSQL 12 or newer",
    "mysql": "upgrade to MySQL 8.0.1+ or MariaDB 10.6+ (the first with SKIP LOCKED)",
    "mssql": "upgrade to SQL Server 2016 (13.0) or newer",
    "sqlite": "use a Python whose sqlite3 links SQLite 3.35 or newer (UPDATE ... RETURNING)",
}


def server_label(conn: Connection) -> str:
    """``PostgreSQL 15.4``, ``MariaDB 10.11.6``, ``SQL Server 16.0.1000``, ``SQLite 3.45.1``."""
    dialect = conn.dialect
    version = ".".join(str(v) for v in (dialect.server_version_info or ()) if isinstance(v, int))
    if dialect.name == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    if dialect.name in ("mysql", "mariadb"):
        return f"{'MariaDB' if getattr(dialect, 'is_mariadb', False) else 'MySQL'} {version}"
    if dialect.name == "mssql":
        return f"SQL Server {version}"
    if dialect.name == "postgresql":
        return f"PostgreSQL {version}"
    return f"{dialect.name} {version}".strip()


def _check_version(ctx: _Context) -> Iterable[Finding]:
    label = server_label(ctx.conn)
    try:
        ctx.outbox.dialect.check(ctx.conn)
    except UnsupportedDatabase as exc:
        yield Finding(
            "version",
            Severity.ERROR,
            str(exc),
            fix=_UPGRADE.get(ctx.name),
            details={"server": label},
        )
        return
    yield Finding(
        "version",
        Severity.OK,
        f"{label}: {_LOCKING.get(ctx.name, 'supported')}",
        details={"server": label},
    )


# -- isolation ------------------------------------------------------------------------


def _check_isolation(ctx: _Context) -> Iterable[Finding]:
    if ctx.name == "postgresql":
        yield from _postgresql_isolation(ctx)
    elif ctx.name == "mysql":
        yield from _mysql_isolation(ctx)
    elif ctx.name == "mssql":
        yield from _mssql_isolation(ctx)
    elif ctx.name == "sqlite":
        yield Finding(
            "isolation",
            Severity.OK,
            "SQLite runs one writer at a time: each claim is a BEGIN IMMEDIATE transaction",
        )


def _postgresql_isolation(ctx: _Context) -> Iterable[Finding]:
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


def _mysql_isolation(ctx: _Context) -> Iterable[Finding]:
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
    relay_conn = dialect.connect(ctx.outbox.engine)
    try:
        dialect.prepare(relay_conn)
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


def _mssql_isolation(ctx: _Context) -> Iterable[Finding]:
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


# -- tables, keys and indexes -------------------------------------------------------------


def _tables(ctx: _Context) -> list[tuple[str, sa.Table]]:
    return [("outbox", ctx.outbox.tables.outbox), ("inbox", ctx.outbox.tables.inbox)]


def _check_tables(ctx: _Context) -> Iterable[Finding]:
    inspector = sa.inspect(ctx.conn)
    for key, table in _tables(ctx):
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
    if "inbox" in ctx.present:
        yield from _inbox_primary_key(ctx, inspector)
    if ctx.name == "mysql" and ctx.present:
        yield from _mysql_engines(ctx)
    if ctx.present == {"outbox", "inbox"}:
        names = ", ".join(t.fullname for _, t in _tables(ctx))
        yield Finding("tables", Severity.OK, f"tables {names} exist")


def _inbox_primary_key(ctx: _Context, inspector: sa.Inspector) -> Iterable[Finding]:
    table = ctx.outbox.tables.inbox
    found = inspector.get_pk_constraint(table.name, schema=table.schema)
    columns = [str(c).lower() for c in found.get("constrained_columns") or []]
    if columns == ["consumer", "event_id"]:
        return
    if ctx.name == "sqlite":
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


def _mysql_engines(ctx: _Context) -> Iterable[Finding]:
    # information_schema names are case-insensitive: lower case needs no quoting.
    info = sa.table(
        "tables",
        sa.column("table_schema"),
        sa.column("table_name"),
        sa.column("engine"),
        schema="information_schema",
    )
    wanted = {t.name: t for key, t in _tables(ctx) if key in ctx.present}
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


#: Why each index of schema.py matters, by its leading columns.
_INDEX_PURPOSE = {
    ("state", "id"): "claims read pending rows in id order through it",
    ("state", "key", "id"): "ordered claims: the walk over keys with pending rows and the "
    "head-of-key check",
    ("state", "lease_until"): "returning expired leases",
    ("event_id",): "event ids must stay unique",
    ("id",): "a partial index of pending rows keeps the claim's scan small",
    ("processed_at",): "inbox cleanup by age",
}


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
    tables.metadata.create_all(mock, tables=[tables.outbox, tables.inbox], checkfirst=False)
    return ddl


def _check_indexes(ctx: _Context) -> Iterable[Finding]:
    inspector = sa.inspect(ctx.conn)
    wanted = expected_indexes(ctx.outbox, ctx.conn.dialect)
    missing = 0
    for key, table in _tables(ctx):
        if key not in ctx.present:
            continue
        found = [
            (
                tuple(str(c).lower() for c in ix.get("column_names") or [] if c is not None),
                bool(ix.get("unique")),
            )
            for ix in inspector.get_indexes(table.name, schema=table.schema)
        ]
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            if str(index.name) not in wanted:
                continue  # not created on this database
            columns = tuple(c.name.lower() for c in index.columns)
            if any(cols == columns and (unique or not index.unique) for cols, unique in found):
                continue
            missing += 1
            purpose = _INDEX_PURPOSE.get(columns, "part of the outbox schema")
            yield Finding(
                "index",
                Severity.ERROR if key == "outbox" else Severity.WARNING,
                f"missing {'unique ' if index.unique else ''}index {index.name} on "
                f"{table.fullname} ({', '.join(columns)}): {purpose}",
                fix=wanted[str(index.name)],
                details={"table": table.fullname, "index": index.name, "columns": list(columns)},
            )
    if ctx.present and not missing:
        yield Finding("index", Severity.OK, f"all {len(wanted)} expected indexes are present")


# -- SQLite ---------------------------------------------------------------------------------


def _check_journal_mode(ctx: _Context) -> Iterable[Finding]:
    if ctx.name != "sqlite":
        return
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


# -- PostgreSQL: dead row versions and what holds vacuum back ----------------------------


def _check_dead_tuples(ctx: _Context) -> Iterable[Finding]:
    if ctx.name != "postgresql":
        return
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
    for key, table in _tables(ctx):
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
        last = "never" if vacuumed is None else f"{_age((now - vacuumed).total_seconds())} ago"
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


def _check_long_transactions(ctx: _Context) -> Iterable[Finding]:
    if ctx.name == "postgresql":
        yield from _postgresql_long_transactions(ctx)
    elif ctx.name == "mysql":
        yield from _mysql_long_transactions(ctx)


def _postgresql_long_transactions(ctx: _Context) -> Iterable[Finding]:
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
    threshold = _age(ctx.limits.long_transaction)
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
            f"{_age(float(seconds))}{', holds back vacuum' if holds else ''}: {query[:60]}"
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


def _mysql_long_transactions(ctx: _Context) -> Iterable[Finding]:
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
    threshold = _age(ctx.limits.long_transaction)
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
        f"{_age(float(f['seconds']))}"
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


# -- the events themselves --------------------------------------------------------------


def _check_backlog(ctx: _Context) -> Iterable[Finding]:
    if "outbox" not in ctx.present:
        return
    t = ctx.outbox.table
    dialect = ctx.outbox.dialect
    now = dialect.now()
    pending = t.c.state == int(State.PENDING)
    pending_n, due_n, oldest_due, expired, db_now = ctx.conn.execute(
        sa.select(
            sa.select(sa.func.count()).select_from(t).where(pending).scalar_subquery(),
            sa.select(sa.func.count())
            .select_from(t)
            .where(pending, t.c.available_at <= now)
            .scalar_subquery(),
            sa.select(sa.func.min(t.c.available_at))
            .where(pending, t.c.available_at <= now)
            .scalar_subquery(),
            sa.select(sa.func.count())
            .select_from(t)
            .where(t.c.state == int(State.LEASED), t.c.lease_until < now)
            .scalar_subquery(),
            now,
        )
    ).one()
    waited = None
    if oldest_due is not None:
        waited = max(0.0, (_aware(db_now) - _aware(oldest_due)).total_seconds())
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
            f"the oldest due event has waited {_age(waited)} for a relay (threshold "
            f"{_age(limit)}); {due_n} due of {pending_n} pending{leases}",
            fix="start a relay (outbox relay) or check its logs for errors; if relays run "
            "and cannot keep up, add relays or raise --batch-size",
            details=details,
        )
        return
    age = "nothing due" if waited is None else f"oldest due waited {_age(waited)}"
    yield Finding(
        "backlog",
        Severity.OK,
        f"{pending_n} pending, {age} (threshold {_age(limit)}){leases}",
        details=details,
    )


def _check_dead_events(ctx: _Context) -> Iterable[Finding]:
    if "outbox" not in ctx.present:
        return
    t = ctx.outbox.table
    dead = t.c.state == int(State.DEAD)
    per_topic = (
        sa.select(t.c.topic, sa.func.count().label("n"), sa.func.max(t.c.id).label("last"))
        .where(dead)
        .group_by(t.c.topic)
        .subquery()
    )
    rows = ctx.conn.execute(
        sa.select(per_topic.c.topic, per_topic.c.n, t.c.last_error)
        .join_from(per_topic, t, t.c.id == per_topic.c.last)
        .order_by(per_topic.c.n.desc(), per_topic.c.topic)
    ).all()
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


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


# -- report ---------------------------------------------------------------------------------


def exit_code(findings: Iterable[Finding], *, strict: bool = False) -> int:
    """1 when a finding is an error (or a warning, with ``strict``), else 0."""
    bad = {Severity.ERROR, Severity.WARNING} if strict else {Severity.ERROR}
    return 1 if any(f.severity in bad for f in findings) else 0


def _counts(findings: list[Finding]) -> dict[str, int]:
    return {str(s): sum(1 for f in findings if f.severity == s) for s in Severity}


def render_report(findings: list[Finding], *, title: str | None = None) -> str:
    """The findings as a readable report, worst first, each with its fix."""
    labels = {Severity.OK: "ok", Severity.WARNING: "WARNING", Severity.ERROR: "ERROR"}
    lines = [title, ""] if title else []
    indent = " " * 28
    for f in findings:
        head = f"{labels[f.severity]:<8} {f.check:<18} "
        lines.append(
            textwrap.fill(f.message, width=100, initial_indent=head, subsequent_indent=indent)
        )
        if f.fix:
            # Never wrapped: a fix is often a statement to copy and paste.
            lines.append(f"{indent}fix: {f.fix}")
    counts = _counts(findings)
    lines.append("")
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['ok']} ok")
    return "\n".join(lines)


def report_dict(outbox: Outbox, findings: list[Finding], *, strict: bool = False) -> dict[str, Any]:
    """The JSON form of ``outbox doctor --json``."""
    return {
        "database": mask_url(outbox.url.render_as_string(hide_password=False)),
        "dialect": outbox.dialect.name,
        "table": outbox.table.fullname,
        "healthy": exit_code(findings, strict=strict) == 0,
        "strict": strict,
        "summary": _counts(findings),
        "findings": [f.as_dict() for f in findings],
    }


# -- the click command -------------------------------------------------------------------


@click.command("doctor")
@click.option("--db", "database_url", help="Database URL [env OUTBOX_DATABASE_URL].")
@click.option("--table", help="Outbox table name [default: outbox].")
@click.option("--schema", "schema", help="Database schema of the table.")
@click.option(
    "--dialect", type=click.Choice(DIALECT_NAMES), help="Override the dialect of the URL."
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML settings file [default: ./outbox.toml].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too, not only on errors.")
@click.option(
    "--max-backlog-age",
    default="5m",
    show_default=True,
    help="Longest acceptable wait of the oldest due event.",
)
@click.option(
    "--long-transaction",
    default="5m",
    show_default=True,
    help="PostgreSQL: report transactions open longer than this.",
)
@click.option(
    "--dead-tuple-ratio",
    default=DEAD_TUPLE_RATIO,
    show_default=True,
    type=click.FloatRange(min=0),
    help="PostgreSQL: warn when dead row versions exceed this share of live rows...",
)
@click.option(
    "--min-dead-tuples",
    default=MIN_DEAD_TUPLES,
    show_default=True,
    type=click.IntRange(min=0),
    help="...and number at least this many.",
)
@handle_errors
def doctor_command(
    config_file: str | None,
    as_json: bool,
    strict: bool,
    max_backlog_age: str,
    long_transaction: str,
    dead_tuple_ratio: float,
    min_dead_tuples: int,
    **values: Any,
) -> None:
    """Check the database set-up and explain how to fix what is wrong.

    Exit 0 when healthy, 1 on an error (or a warning with --strict).
    """
    settings = load_settings(values, config_file=config_file)
    if not settings.database_url:
        raise ConfigurationError(
            "no database URL: pass --db, set OUTBOX_DATABASE_URL, or database_url in outbox.toml"
        )
    outbox = Outbox(
        settings.database_url,
        table=settings.table,
        schema=settings.schema,
        dialect=settings.dialect,
    )
    try:
        findings = diagnose(
            outbox,
            max_backlog_age=parse_duration(max_backlog_age, "--max-backlog-age"),
            long_transaction=parse_duration(long_transaction, "--long-transaction"),
            dead_tuple_ratio=dead_tuple_ratio,
            min_dead_tuples=min_dead_tuples,
        )
    finally:
        outbox.dispose()
    if as_json:
        click.echo(json.dumps(report_dict(outbox, findings, strict=strict), default=str))
    else:
        url = mask_url(outbox.url.render_as_string(hide_password=False))
        title = f"outbox doctor: {url}, table {outbox.table.fullname} ({outbox.dialect.name})"
        click.echo(render_report(findings, title=title))
    sys.exit(exit_code(findings, strict=strict))
