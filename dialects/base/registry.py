"""The registry: backend name -> dialect class, imported only when asked for.

Built-in dialects are listed in :data:`REGISTRY`. A dialect shipped by
another package registers under the entry-point group ``outbox_core.dialects``
(name: the backend name, value: ``package.module:Class``); code that is not an
installed package calls :func:`register_dialect`, or names the class itself
(``dialect="package.module:Class"``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Final

from outbox_core.errors import ConfigurationError, UnknownDialect

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

#: The entry-point group a package ships a dialect under.
ENTRY_POINT_GROUP: Final = "outbox_core.dialects"

#: Backend name -> "module:Class" added by :func:`register_dialect`.
_REGISTERED: dict[str, str] = {}


def dialect_families() -> list[str]:
    """One built-in registry name per dialect class (``mariadb`` is ``mysql``'s alias)."""
    seen: dict[str, str] = {}
    for name, target in REGISTRY.items():
        seen.setdefault(target, name)
    return list(seen.values())


def register_dialect(name: str, target: str) -> None:
    """Serve backend ``name`` with the dialect class at ``target`` (``package.module:Class``)."""
    if not _is_dotted(target):
        raise ConfigurationError(f"dialect class must be 'package.module:Class', got {target!r}")
    key = name.lower()
    if key in REGISTRY and REGISTRY[key] != target:
        raise ConfigurationError(f"{name!r} is a built-in dialect and cannot be replaced")
    _REGISTERED[key] = target


def _plugins() -> dict[str, EntryPoint]:
    """Installed packages' dialects, read from their metadata when asked (never at import)."""
    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name.lower(), entry)
    return found


def known_dialects() -> list[str]:
    """The names accepted by :func:`get_dialect`: built-in, registered and installed plug-ins."""
    return sorted(set(REGISTRY) | set(_REGISTERED) | set(_plugins()))


def get_dialect(name: str) -> type[Dialect]:
    """Return the dialect class for a backend name; raise :class:`UnknownDialect` otherwise.

    Looked up in :data:`REGISTRY`, :func:`register_dialect`'s names, the
    ``outbox_core.dialects`` entry points; a ``package.module:Class`` name is
    imported as it is.
    """
    key = name.lower()
    target = REGISTRY.get(key) or _REGISTERED.get(key) or (name if _is_dotted(name) else None)
    if target is not None:
        module_name, _, cls_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if target in REGISTRY.values():
                raise  # a built-in's driver import: the caller reports it as it always has
            raise UnknownDialect(f"cannot import the dialect {target!r}") from None
        loaded: object = getattr(module, cls_name, None)
    else:
        entry = _plugins().get(key)
        if entry is None:
            raise UnknownDialect(
                f"unknown database dialect {name!r}; supported: {', '.join(known_dialects())}"
                f" (a package adds one under the entry-point group {ENTRY_POINT_GROUP})"
            )
        target = entry.value
        try:
            loaded = entry.load()
        except Exception as exc:  # a broken plug-in: say which one
            raise UnknownDialect(
                f"the dialect {name!r} ({target}) cannot be loaded: {type(exc).__name__}: {exc}"
            ) from exc
    from outbox_core.dialects.base import Dialect

    if not (isinstance(loaded, type) and issubclass(loaded, Dialect)):
        raise UnknownDialect(f"the dialect {name!r} ({target}) is not a Dialect subclass")
    return loaded


def _is_dotted(target: str) -> bool:
    module_name, sep, cls_name = target.partition(":")
    return bool(sep and module_name and cls_name)
