"""Helpers shared by the contract, property and chaos suites."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def lock_timeout_sql(backend: str, seconds: int) -> str | None:
    """The statement that bounds lock waits on ``backend`` (None: SQLite has no row locks)."""
    if backend == "postgresql":
        return f"SET lock_timeout = '{seconds}s'"
    if backend == "mysql":
        return f"SET SESSION innodb_lock_wait_timeout = {seconds}"
    if backend == "mssql":
        return f"SET LOCK_TIMEOUT {seconds * 1000}"
    return None


def set_lock_timeout(conn: sa.Connection, backend: str, seconds: int) -> None:
    """Bound lock waits on one connection, so a claim that waited fails loudly."""
    sql = lock_timeout_sql(backend, seconds)
    if sql:
        conn.exec_driver_sql(sql)
        conn.commit()


def bound_lock_waits(engine: sa.Engine, backend: str, seconds: int) -> None:
    """Bound lock waits on every new connection of ``engine``."""
    sql = lock_timeout_sql(backend, seconds)
    if sql is None:
        return

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute(sql)
        cursor.close()
        if backend != "mssql":
            dbapi_conn.commit()
