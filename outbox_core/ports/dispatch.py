"""Which transaction port serves the connection a caller passes to ``enqueue``."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from outbox_core.errors import ConfigurationError
from outbox_core.ports.asyncdb import AsyncTransaction
from outbox_core.ports.dbapi import DBAPITransaction, not_accepted
from outbox_core.ports.drivers import ASYNC_DRIVERS, SYNC_DRIVERS, find_driver
from outbox_core.transaction import SQLAlchemyTransaction, TransactionPort

#: SQLAlchemy dialect names -> the toolkit's dialect families.
_FAMILIES = {"mariadb": "mysql"}


def transaction_port(conn: Any, what: str, family: str) -> TransactionPort:
    """The port for a sync ``conn`` of an outbox on database ``family``.

    A SQLAlchemy ``Connection`` or ``Session``, a DB-API connection of a
    known driver, or a :class:`DBAPITransaction` built over one (checked to
    be in a transaction). Anything else, an async
    connection included, raises :class:`ConfigurationError` naming what was
    passed and what is accepted.
    """
    if isinstance(conn, Connection | Session):
        return SQLAlchemyTransaction.of(conn, what)
    if isinstance(conn, DBAPITransaction):
        # Built by a framework, with its own commit hook.
        port = conn
    elif find_driver(conn, SYNC_DRIVERS) is None:
        message = not_accepted(what, conn)
        if _is_async(conn):
            cls = type(conn)
            message = (
                f"{what} got an async connection ({cls.__module__}.{cls.__qualname__}): "
                f"await {what}_async(conn, ...) instead"
            )
        raise ConfigurationError(message)
    else:
        port = DBAPITransaction(conn)
    check_family(what, port.driver.name, family, port.driver_info.label)
    port.require_transaction(what)
    return port


def async_transaction_port(conn: Any, what: str, family: str) -> AsyncTransaction:
    """The port for an asyncpg or psycopg async ``conn`` (checked to be in a transaction)."""
    port = AsyncTransaction(conn)
    check_family(what, port.driver.name, family, port.driver_info.label)
    port.require_transaction(what)
    return port


def check_family(what: str, dialect_name: str, family: str, label: str) -> None:
    """Refuse a connection to another kind of database than the outbox's."""
    theirs = _FAMILIES.get(dialect_name, dialect_name)
    if theirs != family:
        raise ConfigurationError(
            f"{what} got a {label} connection ({theirs}), but this outbox is on {family}: "
            "the connection must be to the outbox's own database"
        )


def _is_async(conn: object) -> bool:
    if find_driver(conn, ASYNC_DRIVERS) is not None:
        return True
    return any(
        f"{c.__module__}.{c.__qualname__}".startswith("sqlalchemy.ext.asyncio.")
        for c in type(conn).__mro__
    )
