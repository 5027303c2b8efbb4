"""Transaction ports beyond SQLAlchemy: ``enqueue`` on the connection a service already has.

- :class:`DBAPITransaction`: a DB-API 2 connection of psycopg 3, psycopg2,
  PyMySQL, mysqlclient, sqlite3 or pyodbc.
- :class:`AsyncTransaction`: an asyncpg connection, or psycopg's ``AsyncConnection``.

Both compile the toolkit's SQLAlchemy Core statements with the driver's own
SQLAlchemy dialect and run them on the caller's connection, in its
transaction. :func:`transaction_port` picks the port for what was passed.
"""

from outbox_core.ports.asyncdb import AsyncTransaction
from outbox_core.ports.commit_watch import COMMIT_WATCH, CommitWatch
from outbox_core.ports.dbapi import DBAPITransaction
from outbox_core.ports.dispatch import async_transaction_port, transaction_port
from outbox_core.ports.drivers import ASYNC_DRIVERS, SYNC_DRIVERS, Driver

__all__ = [
    "ASYNC_DRIVERS",
    "COMMIT_WATCH",
    "SYNC_DRIVERS",
    "AsyncTransaction",
    "CommitWatch",
    "DBAPITransaction",
    "Driver",
    "async_transaction_port",
    "transaction_port",
]
