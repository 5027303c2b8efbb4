"""The registry: backend name -> dialect class, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from outbox_core.errors import UnknownDialect

if TYPE_CHECKING:
    from outbox_core.dialects.base import Dialect

#: Backend name -> "module:Class", imported only when asked for, so a user
#: with one driver installed never needs the others.
REGISTRY: dict[str, str] = {
    "postgresql": "outbox_core.dialects.postgresql:PostgresqlDialect",
    "mysql": "outbox_core.dialects.mysql:MysqlDialect",
    "mariadb": "outbox_core.dialects.mysql:MysqlDialect",
    "mssql": "outbox_core.dialects.mssql:MssqlDialect",
    "sqlite": "outbox_core.dialects.sqlite:SqliteDialect",
}


def dialect_families() -> list[str]:
    """One registry name per dialect class (``mariadb`` is ``mysql``'s alias)."""
    seen: dict[str, str] = {}
    for name, target in REGISTRY.items():
        seen.setdefault(target, name)
    return list(seen.values())


def known_dialects() -> list[str]:
    """The names accepted by :func:`get_dialect`."""
    return sorted(REGISTRY)


def get_dialect(name: str) -> type[Dialect]:
    """Return the dialect class for a backend name; raise :class:`UnknownDialect` otherwise."""
    target = REGISTRY.get(name.lower())
    if target is None:
        raise UnknownDialect(
            f"unknown database dialect {name!r}; supported: {', '.join(known_dialects())}"
        )
    module_name, _, cls_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls: type[Dialect] = getattr(module, cls_name)
    return cls
