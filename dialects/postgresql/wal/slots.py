"""The slot and publication with ordinary SQL on the project's (psycopg 3) engine.

Ordinary statements on a normal connection; the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from outbox_core.dialects.postgresql.wal.errors import (
    PublicationMissing,
    ReplicationNotPermitted,
    SlotInUse,
    SlotInvalidated,
    SlotMissing,
    WalLevelNotLogical,
)
from outbox_core.dialects.postgresql.wal.names import (
    lsn_or_none,
    parse_lsn,
    quote_identifier,
    validate_slot_name,
)
from outbox_core.dialects.postgresql.wal.pgoutput import WalError
from outbox_core.errors import ConfigurationError
from outbox_core.redaction import redact


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None) or exc
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return None if state is None else str(state)


def _failed(operation: str, exc: sa.exc.DBAPIError) -> WalError:
    """The typed error of a failed statement (the driver error's own text, password-free)."""
    detail = redact(f"{operation} failed: {getattr(exc, 'orig', None) or exc}")
    state = _sqlstate(exc)
    if state == "55000" and "wal_level" in detail:
        return WalLevelNotLogical(detail)
    if state == "42501":
        return ReplicationNotPermitted(detail)
    if state == "55006":
        return SlotInUse(detail)
    return WalError(detail)


def wal_level(conn: sa.Connection) -> str:
    """The server's ``wal_level`` (``minimal``, ``replica`` or ``logical``)."""
    return str(conn.execute(sa.text("SHOW wal_level")).scalar_one())


def require_logical_wal(conn: sa.Connection) -> None:
    """Raise :class:`WalLevelNotLogical` unless ``wal_level = logical``."""
    level = wal_level(conn)
    if level != "logical":
        raise WalLevelNotLogical(
            f"wal_level is {level!r}, logical decoding needs 'logical' "
            "(ALTER SYSTEM SET wal_level = logical, then restart the server)"
        )


def can_replicate(conn: sa.Connection) -> bool:
    """The current role may open replication connections (REPLICATION or superuser)."""
    return bool(
        conn.execute(
            sa.text("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user")
        ).scalar()
    )


def publication_exists(conn: sa.Connection, name: str) -> bool:
    """A publication of this name exists in the connection's database."""
    return (
        conn.execute(
            sa.text("SELECT 1 FROM pg_publication WHERE pubname = :name"), {"name": name}
        ).first()
        is not None
    )


def create_publication(
    conn: sa.Connection,
    name: str,
    *,
    table: str,
    schema: str = "public",
    publish: Sequence[str] = ("insert",),
) -> bool:
    """``CREATE PUBLICATION name FOR TABLE schema.table WITH (publish = ...)``.

    ``publish`` names the operations sent (``insert``, ``update``, ``delete``).
    False (and nothing done) when a publication of that name exists already.
    Create it before the slot: the slot decodes a change with the catalog of
    its time, and a publication younger than the change is not found.
    """
    operations = ", ".join(op for op in publish if op in ("insert", "update", "delete"))
    if not operations or len(operations.split(", ")) != len(publish):
        raise ConfigurationError(f"publish: insert, update or delete, not {list(publish)!r}")
    statement = (
        f"CREATE PUBLICATION {quote_identifier(name, 'publication name')} FOR TABLE "
        f"{quote_identifier(schema, 'schema name')}.{quote_identifier(table, 'table name')} "
        f"WITH (publish = '{operations}')"
    )
    if publication_exists(conn, name):
        return False
    try:
        conn.execute(sa.text(statement))
    except sa.exc.DBAPIError as exc:
        raise _failed(f"creating publication {name}", exc) from exc
    return True


def drop_publication(conn: sa.Connection, name: str) -> None:
    """``DROP PUBLICATION IF EXISTS name``."""
    conn.execute(
        sa.text(f"DROP PUBLICATION IF EXISTS {quote_identifier(name, 'publication name')}")
    )


def create_slot(conn: sa.Connection, name: str) -> int:
    """Create the logical slot ``name`` (plugin ``pgoutput``); the LSN it starts at.

    The statement waits for the transactions running elsewhere to end, and
    refuses to run in a transaction that has written anything.
    """
    try:
        lsn = conn.execute(
            sa.text("SELECT lsn FROM pg_create_logical_replication_slot(:name, 'pgoutput')"),
            {"name": validate_slot_name(name)},
        ).scalar_one()
    except sa.exc.DBAPIError as exc:
        raise _failed(f"creating replication slot {name}", exc) from exc
    return parse_lsn(str(lsn))


def drop_slot(conn: sa.Connection, name: str) -> bool:
    """Drop the slot ``name`` if it exists (:class:`SlotInUse` while a reader has it)."""
    if slot_facts(conn, validate_slot_name(name)) is None:
        return False
    try:
        conn.execute(sa.text("SELECT pg_drop_replication_slot(:name)"), {"name": name})
    except sa.exc.DBAPIError as exc:
        raise _failed(f"dropping replication slot {name}", exc) from exc
    return True


@dataclass(frozen=True)
class SlotFacts:
    """A replication slot as ``pg_replication_slots`` shows it, LSNs as ints.

    ``retained_bytes`` is the WAL the slot keeps on disk (current WAL
    position minus ``restart_lsn``); ``lag_bytes`` the WAL written since its
    confirmed position (what its reader has not confirmed yet, outbox or
    not); ``wal_status`` and ``safe_wal_size`` are ``None`` before
    PostgreSQL 13.
    """

    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    retained_bytes: int | None
    wal_status: str | None
    safe_wal_size: int | None
    lag_bytes: int | None = None


def slot_facts(conn: sa.Connection, name: str) -> SlotFacts | None:
    """The slot ``name``, or None when it does not exist."""
    newer = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
    # wal_status and safe_wal_size came with PostgreSQL 13.
    extra = "wal_status, safe_wal_size" if int(newer) >= 130000 else "NULL, NULL"
    current = (
        "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"
    )
    row = conn.execute(
        sa.text(
            "SELECT slot_name, plugin, slot_type, database, active, active_pid, "
            "restart_lsn::text, confirmed_flush_lsn::text, "
            f"pg_wal_lsn_diff({current}, restart_lsn)::bigint, {extra}, "
            f"pg_wal_lsn_diff({current}, confirmed_flush_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = :name"
        ),
        {"name": name},
    ).first()
    if row is None:
        return None
    return SlotFacts(
        name=row[0],
        plugin=row[1],
        slot_type=row[2],
        database=row[3],
        active=bool(row[4]),
        active_pid=row[5],
        restart_lsn=lsn_or_none(row[6]),
        confirmed_flush_lsn=lsn_or_none(row[7]),
        retained_bytes=None if row[8] is None else int(row[8]),
        wal_status=row[9],
        safe_wal_size=None if row[10] is None else int(row[10]),
        lag_bytes=None if row[11] is None else max(0, int(row[11])),
    )


def check_ready(
    conn: sa.Connection,
    *,
    slot: str,
    publication: str,
    table: tuple[str | None, str] | None = None,
) -> list[WalError]:
    """Every reason a :class:`WalStream` of ``slot`` / ``publication`` would be refused.

    An empty list when the server is ready: ``wal_level = logical``, the role
    may replicate, the slot exists as a ``pgoutput`` slot of this database
    that has kept its WAL, the publication exists and, given ``table``
    (schema, name; schema None: the current one), publishes that table's
    inserts and updates (a replay reaches the relay as an update).
    """
    problems: list[WalError] = []
    try:
        require_logical_wal(conn)
    except WalLevelNotLogical as exc:
        problems.append(exc)
    if not can_replicate(conn):
        problems.append(
            ReplicationNotPermitted(
                "the role has neither REPLICATION nor superuser (ALTER ROLE ... WITH REPLICATION)"
            )
        )
    facts = slot_facts(conn, slot)
    database = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    if facts is None:
        problems.append(SlotMissing(f"replication slot {slot!r} does not exist"))
    elif facts.plugin != "pgoutput" or facts.database != database:
        problems.append(
            SlotMissing(
                f"replication slot {slot!r} is not a pgoutput slot of database {database!r} "
                f"(plugin {facts.plugin!r}, database {facts.database!r})"
            )
        )
    elif facts.wal_status == "lost":
        problems.append(
            SlotInvalidated(
                f"replication slot {slot!r} lost WAL it needed (max_slot_wal_keep_size)"
            )
        )
    if not publication_exists(conn, publication):
        problems.append(PublicationMissing(f"publication {publication!r} does not exist"))
    elif table is not None:
        row = conn.execute(
            sa.text(
                "SELECT p.pubinsert, p.pubupdate, EXISTS (SELECT 1 FROM pg_publication_tables t "
                "WHERE t.pubname = p.pubname AND t.schemaname = COALESCE(:schema, "
                "current_schema()) AND t.tablename = :table) FROM pg_publication p "
                "WHERE p.pubname = :name"
            ),
            {"name": publication, "schema": table[0], "table": table[1]},
        ).one()
        missing = [what for what, ok in zip(("inserts", "updates"), row[:2], strict=True) if not ok]
        if not row[2]:
            missing.insert(0, f"table {table[1]!r}")
        if missing:
            problems.append(
                PublicationMissing(
                    f"publication {publication!r} does not publish {' or '.join(missing)} "
                    "(ALTER PUBLICATION ... ADD TABLE / SET (publish = 'insert, update'))"
                )
            )
    return problems
