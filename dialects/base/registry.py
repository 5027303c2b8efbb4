"""The registry: backend name -> dialect class, imported only when asked for.

The names and where their classes come from are
:mod:`~outbox_core.dialects.base.names`' (built-ins in :data:`REGISTRY`,
:func:`register_dialect`, the entry-point group ``outbox_core.dialects``);
:func:`get_dialect` loads one and checks it is a :class:`Dialect`.
"""

from __future__ import annotations

from outbox_core.dialects.base.dialect import Dialect
from outbox_core.dialects.base.names import (
    ENTRY_POINT_GROUP,
    PLUGINS,
    REGISTRY,
    dialect_families,
    known_dialects,
    load_dialect,
    register_dialect,
)
from outbox_core.errors import UnknownDialect

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS",
    "REGISTRY",
    "dialect_families",
    "get_dialect",
    "known_dialects",
    "register_dialect",
]


def get_dialect(name: str) -> type[Dialect]:
    """Return the dialect class for a backend name; raise :class:`UnknownDialect` otherwise.

    Looked up in :data:`REGISTRY`, :func:`register_dialect`'s names, the
    ``outbox_core.dialects`` entry points; a ``package.module:Class`` name is
    imported as it is.
    """
    loaded, where = load_dialect(name)
    if not issubclass(loaded, Dialect):
        raise UnknownDialect(f"the dialect {name!r} ({where}) is not a Dialect subclass")
    return loaded
