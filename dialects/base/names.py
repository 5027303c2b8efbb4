"""Backend names and the classes that serve them, imported only when asked for.

Built-in dialects are listed in :data:`REGISTRY`. A dialect shipped by
another package registers under the entry-point group ``outbox_core.dialects``
(name: the backend name, value: ``package.module:Class``); code that is not an
installed package calls :func:`register_dialect`, or names the class itself
(``dialect="package.module:Class"``).

This module does not know the :class:`~outbox_core.dialects.base.dialect.Dialect`
class: :mod:`outbox_core.schema` reads a family's flags through it, and the
dialect is built on the schema. :func:`~outbox_core.dialects.base.registry.get_dialect`
checks the class it loads.
"""

from __future__ import annotations

from typing import Any, Final

from outbox_core.errors import UnknownDialect
from outbox_core.plugins import PluginBroken, PluginImportFailed, PluginNotFound, PluginRegistry

#: Backend name -> "module:Class", imported only when asked for, so a user
#: with one driver installed never needs the others.
REGISTRY: dict[str, str] = {
    "postgresql": "outbox_core.dialects.postgresql:PostgresqlDialect",
    "mysql": "outbox_core.dialects.mysql:MysqlDialect",
    "mariadb": "outbox_core.dialects.mysql:MysqlDialect",
    "mssql": "outbox_core.dialects.mssql:MssqlDialect",
    "sqlite": "outbox_core.dialects.sqlite:SqliteDialect",
}

#: The entry-point group a package ships a dialect under.
ENTRY_POINT_GROUP: Final = "outbox_core.dialects"

#: Built-ins, :func:`register_dialect`'s classes and installed plug-ins.
PLUGINS = PluginRegistry("dialect", ENTRY_POINT_GROUP, REGISTRY)


def dialect_families() -> list[str]:
    """One built-in registry name per dialect class (``mariadb`` is ``mysql``'s alias)."""
    seen: dict[str, str] = {}
    for name, target in REGISTRY.items():
        seen.setdefault(target, name)
    return list(seen.values())


def register_dialect(name: str, target: str) -> None:
    """Serve backend ``name`` with the dialect class at ``target`` (``package.module:Class``)."""
    PLUGINS.register(name, target, shown=repr(name))


def known_dialects() -> list[str]:
    """The names accepted by :func:`load_dialect`: built-in, registered and installed plug-ins."""
    return PLUGINS.known()


def load_dialect(name: str) -> tuple[type[Any], str]:
    """The class that serves backend ``name``, imported, and where it came from.

    Looked up in :data:`REGISTRY`, :func:`register_dialect`'s names, the
    ``outbox_core.dialects`` entry points; a ``package.module:Class`` name is
    imported as it is. Raises :class:`UnknownDialect` when there is none, or
    when what the name stands for is no class; whether it is a dialect class
    is :func:`~outbox_core.dialects.base.registry.get_dialect`'s to check.
    """
    try:
        loaded, where = PLUGINS.resolve(name, dotted=True)
    except PluginImportFailed as exc:
        if exc.builtin:
            # A built-in's driver import: the caller reports it as it always has.
            raise exc.cause from None
        raise UnknownDialect(f"cannot import the dialect {exc.target!r}") from None
    except PluginNotFound:
        raise UnknownDialect(
            f"unknown database dialect {name!r}; supported: {', '.join(known_dialects())}"
            f" (a package adds one under the entry-point group {ENTRY_POINT_GROUP})"
        ) from None
    except PluginBroken as exc:
        raise UnknownDialect(f"the dialect {name!r} {exc.where} cannot be loaded: {exc}") from exc
    if not isinstance(loaded, type):
        raise UnknownDialect(f"the dialect {name!r} ({where}) is not a Dialect subclass")
    return loaded, where
