"""The database URL of a Django connection, built from ``DATABASES`` (for relays and the CLI).

The driver is the one Django's backend itself uses: psycopg 3 or psycopg2
for ``postgresql``, mysqlclient (``MySQLdb``) for ``mysql`` (PyMySQL when a
project installed it as ``MySQLdb``), the standard library for ``sqlite3``.
The URL carries the password: render it only where it is needed, and mask
it everywhere else (:func:`outbox_core.redaction.mask_url`).
"""

from __future__ import annotations

from typing import Any

from django.db import connections
from sqlalchemy.engine import URL

from outbox_core.errors import ConfigurationError

#: libpq connection options passed on from ``OPTIONS`` (the others are Django's own).
_PG_OPTIONS = frozenset(
    {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "application_name",
        "connect_timeout",
        "options",
        "target_session_attrs",
        "service",
        "passfile",
        "channel_binding",
    }
)
#: mysqlclient / PyMySQL connection options passed on from ``OPTIONS``.
_MYSQL_OPTIONS = frozenset({"charset", "unix_socket", "read_default_file", "connect_timeout"})


def vendor_of(alias: str) -> str:
    """``postgresql``, ``mysql``, ``sqlite``, ... (Django's name for the backend's database)."""
    return str(connections[alias].vendor)


def database_url(alias: str) -> URL:
    """The SQLAlchemy URL of ``DATABASES[alias]`` as Django connects to it now.

    Under Django's test runner that is the test database (Django renames it
    in place). Refused with the reason: a backend the toolkit has no dialect
    for, a private ``:memory:`` SQLite database.
    """
    conn = connections[alias]
    s: dict[str, Any] = conn.settings_dict
    options = s.get("OPTIONS") or {}
    port = int(s["PORT"]) if s.get("PORT") else None
    if conn.vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        query = {k: str(v) for k, v in options.items() if k in _PG_OPTIONS}
        return URL.create(
            "postgresql+psycopg" if is_psycopg3 else "postgresql+psycopg2",
            username=s.get("USER") or None,
            password=s.get("PASSWORD") or None,
            host=s.get("HOST") or None,
            port=port,
            database=s.get("NAME") or None,
            query=query,
        )
    if conn.vendor == "mysql":
        import MySQLdb

        # PyMySQL.install_as_MySQLdb() makes MySQLdb PyMySQL: use it by its name.
        driver = "pymysql" if MySQLdb.__name__.startswith("pymysql") else "mysqldb"
        query = {k: str(v) for k, v in options.items() if k in _MYSQL_OPTIONS}
        query.setdefault("charset", "utf8mb4")
        return URL.create(
            f"mysql+{driver}",
            username=s.get("USER") or None,
            password=s.get("PASSWORD") or None,
            host=s.get("HOST") or None,
            port=port,
            database=s.get("NAME") or None,
            query=query,
        )
    if conn.vendor == "sqlite":
        return _sqlite_url(str(s["NAME"]))
    raise ConfigurationError(
        f"DATABASES[{alias!r}]: the outbox has no dialect for Django's {conn.vendor!r} backend "
        "(it supports postgresql, mysql and sqlite3)"
    )


def _sqlite_url(name: str) -> URL:
    if name == ":memory:" or not name:
        raise ConfigurationError(
            "a private in-memory SQLite database (':memory:') is visible to its own connection "
            "only: give DATABASES a file, or Django's shared 'file:...?mode=memory&cache=shared'"
        )
    if name.startswith("file:"):
        # An SQLite URI (Django's in-memory test database is one): keep its parameters.
        path, _, params = name.partition("?")
        query = dict(p.split("=", 1) for p in params.split("&") if "=" in p)
        query["uri"] = "true"
        return URL.create("sqlite", database=path, query=query)
    return URL.create("sqlite", database=name)
