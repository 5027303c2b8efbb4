"""What is being tested: the server behind each URL, the drivers, the checkout.

:func:`probe` connects once, asks the toolkit's dialect for the server's
product and version (:meth:`Dialect.server_info`, which also tells MariaDB
from MySQL), runs the dialect's own ``check`` (so an unsupported server is
reported as such rather than failing every test) and names the column by
what it found, e.g. ``PostgreSQL 15.6``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sqlite3
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from compat_matrix.model import OK, UNREACHABLE, UNSUPPORTED, Database
from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.errors import UnsupportedDatabase
from outbox_core.schema import OutboxTables

#: Backends as the test suite names them, and the SQLAlchemy backend names each accepts.
BACKENDS: dict[str, tuple[str, ...]] = {
    "sqlite": ("sqlite",),
    "postgresql": ("postgresql",),
    "mysql": ("mysql", "mariadb"),
    "mssql": ("mssql",),
}
#: Distributions whose versions the matrix reports.
DISTRIBUTIONS: tuple[str, ...] = (
    "SQLAlchemy",
    "psycopg",
    "psycopg-binary",
    "PyMySQL",
    "pyodbc",
    "aiosqlite",
    "pika",
    "httpx",
    "click",
    "pytest",
    "hypothesis",
)

#: SQLAlchemy driver name -> the distribution that installs it.
_DRIVER_DISTRIBUTIONS = {"pymysql": "PyMySQL", "mysqldb": "mysqlclient", "psycopg2": "psycopg2"}

#: ``scheme://`` and the user info before the last ``@`` of the authority.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")


@dataclass(frozen=True)
class Target:
    """A database to test: its backend and URL (``None`` for SQLite: a temporary file)."""

    backend: str
    url: str | None = None


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``; everything else kept as written."""
    match = _USERINFO.match(url)
    if match is None or ":" not in match.group(2):
        return url
    user = match.group(2).split(":", 1)[0]
    return f"{match.group(1)}{user}:***@{url[match.end() :]}"


def password_of(url: str) -> str | None:
    """The password in ``url``, if any (to scrub it from recorded output)."""
    try:
        password = sa.make_url(url).password
    except Exception:
        return None
    return str(password) if password else None


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` with passwords replaced by ``***``.

    Inside URLs (``:password@``) always; elsewhere only passwords of 10 characters
    or more, so that a password like ``postgres`` does not garble ``postgresql``.
    """
    for secret in secrets:
        if secret:
            text = text.replace(f":{secret}@", ":***@")
            if len(secret) >= 10:
                text = text.replace(secret, "***")
    return text


def check_url(backend: str, url: str) -> None:
    """Raise ``ValueError`` when ``url`` is not a URL for ``backend``."""
    try:
        name = sa.make_url(url).get_backend_name()
    except Exception as exc:
        raise ValueError(f"not a database URL: {mask_url(url)} ({exc})") from exc
    if name not in BACKENDS[backend]:
        raise ValueError(f"{mask_url(url)} is a {name} URL, not {backend}")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver(conn: sa.Connection) -> str:
    """The DBAPI driver and version, plus the client library where it matters."""
    dialect = conn.dialect
    module: Any = dialect.dbapi
    name = str(dialect.driver)
    if name == "pysqlite":
        return f"sqlite3 (Python {platform.python_version()}), SQLite {sqlite3.sqlite_version}"
    # The distribution's version first: pymysql.__version__ is a MySQLdb-compatible fake.
    version = _dist_version(_DRIVER_DISTRIBUTIONS.get(name, name))
    if version is None:
        version = getattr(module, "__version__", None) or getattr(module, "version", None)
    text = f"{name} {version}" if version else name
    try:
        raw: Any = conn.connection.dbapi_connection
        if name.startswith("psycopg") and module is not None:
            libpq = int(module.pq.version())
            text += f", libpq {libpq // 10000}.{libpq % 10000}"
        elif name == "pyodbc" and module is not None and raw is not None:
            text += f", {raw.getinfo(module.SQL_DRIVER_NAME)} {raw.getinfo(module.SQL_DRIVER_VER)}"
    except Exception:  # best effort: the version of a client library is a detail
        pass
    return text


def _dialect(backend: str) -> Dialect:
    """The toolkit's dialect for ``backend``: it identifies the server and refuses what it must."""
    return get_dialect(backend)(OutboxTables.create())


def _check(dialect: Dialect, conn: sa.Connection) -> str | None:
    """The dialect's own refusal, e.g. ``MariaDB 10.5.22 has no SKIP LOCKED ...``."""
    try:
        dialect.check(conn)
    except UnsupportedDatabase as exc:
        return str(exc)
    return None


def probe(target: Target, *, timeout: float = 5.0) -> Database:
    """Connect to ``target`` and describe it; an unreachable server is described too."""
    backend = target.backend
    dialect = _dialect(backend)
    url = target.url or "sqlite://"
    masked = mask_url(target.url) if target.url else "sqlite:///<temporary file per test>"
    db = Database(key="", column="", backend=backend, url=masked)
    try:
        engine = sa.create_engine(
            url, poolclass=NullPool, connect_args=dialect.connect_timeout_args(timeout)
        )
        try:
            with engine.connect() as conn:
                info = dialect.server_info(conn)
                db.product, db.version, db.version_string = info.product, info.version, info.full
                db.column = info.label
                db.driver = _driver(conn)
                refusal = _check(dialect, conn)
                conn.rollback()
        finally:
            engine.dispose()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        password = password_of(url)
        if password:
            reason = scrub(reason, [password])
        db.status, db.reason = UNREACHABLE, reason
        db.product = dialect.family
        db.column = f"{db.product} @ {url_location(url)}"
    else:
        if refusal is not None:
            db.status, db.reason = UNSUPPORTED, refusal
        else:
            db.status = OK
    db.key = slug(db.column)
    return db


def url_location(url: str) -> str:
    """``host:port/database`` of ``url``, to tell apart columns of one version."""
    try:
        u = sa.make_url(url)
    except Exception:
        return "?"
    where = u.host or "localhost"
    if u.port:
        where += f":{u.port}"
    return f"{where}/{u.database}" if u.database else where


def slug(text: str) -> str:
    """A stable key for a column name: ``PostgreSQL 15.6`` -> ``postgresql-15.6``."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "db"


def environment() -> dict[str, str]:
    """Python, platform and the versions of SQLAlchemy, drivers and test tools."""
    env = {
        "Python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "SQLite library": sqlite3.sqlite_version,
    }
    for name in DISTRIBUTIONS:
        env[name] = _dist_version(name) or "not installed"
    return env


def git_commit(root: Path) -> str:
    """The checkout's commit, ``+ uncommitted changes`` when the tree differs from it."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(
                ["git", "-C", str(root), *args],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD") or os.environ.get("GITHUB_SHA") or "unknown"
    dirty = git("status", "--porcelain")
    return f"{commit} + uncommitted changes" if dirty else commit
