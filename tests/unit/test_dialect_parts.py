"""A dialect's parts: built on its primitives, never on the dialect; no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from outbox_core import UnknownDialect
from outbox_core.dialects.base import Dialect, SqlPrimitives, dialect_families, get_dialect
from outbox_core.dialects.base.names import PLUGINS, load_dialect, register_dialect
from outbox_core.schema import OutboxTables

BASE = Path(__file__).parents[2] / "dialects" / "base"
#: The modules of dialects/base the dialect module imports, and the schema
#: (which reads a family's flags by name): none may import the dialect.
BELOW_THE_DIALECT = [
    BASE / "enqueue.py",
    BASE / "inbox.py",
    BASE / "reading.py",
    BASE / "ordered.py",
    BASE / "partitioned.py",
    BASE / "settle.py",
    BASE / "primitives.py",
    BASE / "names.py",
    BASE / "values.py",
    BASE / "budget.py",
    BASE / "session.py",
    BASE / "storage.py",
    Path(__file__).parents[2] / "outbox_core" / "schema.py",
]


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top, in functions or under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("path", BELOW_THE_DIALECT, ids=lambda p: p.name)
def test_the_parts_and_the_schema_never_import_the_dialect(path: Path) -> None:
    banned = {
        "outbox_core.dialects.base",
        "outbox_core.dialects.base.dialect",
        "outbox_core.dialects.base.registry",
        "outbox_core.dialects.base.returning",
    }
    assert not imported(path) & banned


@pytest.mark.parametrize("name", dialect_families())
def test_each_part_holds_the_primitives_not_the_dialect(name: str) -> None:
    dialect = get_dialect(name)(OutboxTables.create("events"))
    parts: list[Any] = [
        dialect.enqueue,
        dialect.inbox,
        dialect.reads,
        dialect.keys,
        dialect.partitions,
        dialect.settle,
    ]
    for part in parts:
        held = vars(part).values()
        assert not any(isinstance(value, Dialect) for value in held), type(part).__name__
        assert isinstance(part.sql, SqlPrimitives)
        assert part.sql.tables is dialect.tables
    # The family's own operations reach the parts (PostgreSQL's array of ids, its lock hint).
    sql = dialect.partitions.sql
    assert sql.id_in.__func__ is type(dialect).id_in  # type: ignore[attr-defined]
    assert sql.lock_rows.__func__ is type(dialect).lock_rows  # type: ignore[attr-defined]
    assert sql.max_batch == dialect.max_batch


def test_a_family_sizes_its_pool_or_keeps_the_one_sqlalchemy_chooses() -> None:
    for name in ("postgresql", "mysql", "mssql"):
        session = get_dialect(name).parts.session()
        assert session.pool_options(size=10, overflow=20) == {"pool_size": 10, "max_overflow": 20}
    assert get_dialect("sqlite").parts.session().pool_options(size=10, overflow=20) == {}


def test_a_name_that_stands_for_no_dialect_class_is_refused() -> None:
    assert load_dialect("postgresql")[0] is get_dialect("postgresql")
    wrong = {
        "not_a_class": "outbox_core.schema:DEFAULT_TABLE",
        "not_a_dialect": "outbox_core.schema:OutboxTables",
    }
    try:
        for name, target in wrong.items():
            register_dialect(name, target)
            with pytest.raises(UnknownDialect, match="is not a Dialect subclass"):
                get_dialect(name)
    finally:
        for name in wrong:
            PLUGINS.registered.pop(name, None)
