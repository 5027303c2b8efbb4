"""The outbox's tables on a Django connection: the DDL ``outbox install`` runs.

The statements are the toolkit's own (:meth:`OutboxTables.ddl`), compiled
for the server Django is connected to (MariaDB told from MySQL), and run
through Django's schema editor by the app's migration. As with ``outbox
install``, only what is missing is created and the indexes an earlier
version used are dropped, so a database set up by ``outbox install`` can
adopt the migration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from django.db.backends.base.base import BaseDatabaseWrapper

from outbox_core.dialects.base import get_dialect
from outbox_core.schema import AddColumn, OutboxTables, missing_columns, obsolete_indexes


@dataclass(frozen=True)
class _Statement:
    kind: str  # "table" or "index"
    table: str
    name: str
    sql: str


def sa_dialect_name(connection: BaseDatabaseWrapper) -> str:
    """The SQLAlchemy dialect name of the server behind a Django connection."""
    vendor = str(connection.vendor)
    if vendor == "mysql" and getattr(connection, "mysql_is_mariadb", False):
        return "mariadb"
    return vendor


def ddl_statements(tables: OutboxTables, dialect_name: str) -> list[_Statement]:
    """Each CREATE TABLE / CREATE INDEX ``outbox install`` runs, in its order."""
    out: list[_Statement] = []

    def record(element: Any, *_: object, **__: object) -> None:
        target = element.element
        sql = str(element.compile(dialect=engine.dialect)).strip()
        if isinstance(target, sa.Table):
            out.append(_Statement("table", target.name, target.name, sql))
        elif isinstance(target, sa.Index):
            assert target.table is not None
            out.append(_Statement("index", target.table.name, str(target.name), sql))

    engine = sa.create_mock_engine(sa.engine.URL.create(dialect_name), record)
    tables.metadata.create_all(engine, tables=tables.all, checkfirst=False)
    return out


def install(connection: BaseDatabaseWrapper, table: str, run: Any) -> None:
    """Create the missing tables, columns and indexes of ``table``; drop obsolete indexes.

    ``run`` executes one SQL statement (the schema editor's ``execute``).
    """
    tables = OutboxTables.create(table)
    name = sa_dialect_name(connection)
    with connection.cursor() as cursor:
        existing = set(connection.introspection.table_names(cursor))
        indexes = {
            t.name: set(connection.introspection.get_constraints(cursor, t.name))
            for t in tables.all
            if t.name in existing
        }
        columns = {
            t.name: {
                c.name.lower()
                for c in connection.introspection.get_table_description(cursor, t.name)
            }
            for t in tables.all
            if t.name in existing
        }
    for t in tables.all:
        if t.name in columns:
            for column in missing_columns(t, columns[t.name]):
                run(str(AddColumn(t, column).compile(dialect=_sa(name))))
    for statement in ddl_statements(tables, name):
        if statement.kind == "table" and statement.table in existing:
            continue
        if statement.kind == "index" and statement.name in indexes.get(statement.table, ()):
            continue
        run(statement.sql)
    partial = get_dialect(name).partial_indexes
    present = indexes.get(tables.outbox.name, set())
    for index in obsolete_indexes(tables.outbox, partial):
        if index in present:
            run(str(sa.schema.DropIndex(_detached(tables, index)).compile(dialect=_sa(name))))


def uninstall(connection: BaseDatabaseWrapper, table: str, run: Any) -> None:
    """Drop the tables of ``table`` (the outbox and its companions) where they exist."""
    tables = OutboxTables.create(table)
    drop(connection, [tables.presence, tables.relays, tables.inbox, tables.outbox], run)


def uninstall_presence(connection: BaseDatabaseWrapper, table: str, run: Any) -> None:
    """Drop the presence table of ``table`` where it exists (migration 0004 reversed)."""
    drop(connection, [OutboxTables.create(table).presence], run)


def drop(connection: BaseDatabaseWrapper, tables: list[sa.Table], run: Any) -> None:
    """Drop each of ``tables`` that exists, in the order given."""
    name = sa_dialect_name(connection)
    with connection.cursor() as cursor:
        existing = set(connection.introspection.table_names(cursor))
    for t in tables:
        if t.name in existing:
            run(str(sa.schema.DropTable(t).compile(dialect=_sa(name))))


def _sa(name: str) -> sa.Dialect:
    return sa.create_mock_engine(sa.engine.URL.create(name), lambda *a, **k: None).dialect


def _detached(tables: OutboxTables, index: str) -> sa.Index:
    from outbox_core.schema import detached_index

    return detached_index(tables.outbox, index)
