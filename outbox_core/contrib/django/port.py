"""The transaction port over Django's own connection and cursor.

Statements run through ``connections[alias].cursor()``, Django's own cursor,
inside the transaction the caller is in: ``CaptureQueriesContext``,
``assertNumQueries``, ``connection.execute_wrapper``, the debug toolbar and
APM instrumentation see the event's ``INSERT`` as any query of the ORM, and
it rolls back with the caller's atomic block, savepoints included. SQLAlchemy
compiles each statement for the driver Django uses, with the ``%s``
placeholders every Django backend takes (SQLite's turns them into ``?``).

Transaction boundaries are Django's to know (:func:`in_transaction`): a
``transaction.atomic()`` block of the caller's own, or a transaction opened
by ``transaction.set_autocommit(False)``; the atomic blocks Django's
``TestCase`` wraps each test in do not count. No ``on_commit`` callback is
registered for the producer's own bookkeeping: only a process that runs a
relay in-process gets one per transaction, which wakes that relay after the
commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from outbox_core.ports import DBAPITransaction
from outbox_core.ports.compiler import StatementCompiler
from outbox_core.ports.drivers import Driver

#: One compiler per driver, for the ``%s`` placeholders Django's cursors take.
_COMPILERS: dict[str, StatementCompiler] = {}


def _compiler(driver: Driver) -> StatementCompiler:
    compiler = _COMPILERS.get(driver.label)
    if compiler is None:
        django_style = dataclasses.replace(driver, paramstyle="format")
        compiler = _COMPILERS.setdefault(driver.label, StatementCompiler(django_style.dialect()))
    return compiler


def user_atomic_block(connection: BaseDatabaseWrapper) -> bool:
    """An atomic block is open that is not one of the blocks ``TestCase`` wraps a test in.

    Django marks those (``Atomic._from_testcase``): inside a ``TestCase``
    the connection is always in an atomic block, which would hide a missing
    ``transaction.atomic()`` in the code under test.
    """
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def in_transaction(connection: BaseDatabaseWrapper) -> bool:
    """The caller has a transaction open: its own atomic block, or autocommit turned off.

    ``transaction.set_autocommit(False)`` opens a transaction that the caller
    ends with ``transaction.commit()`` or ``rollback()``.
    """
    if connection.in_atomic_block:
        return user_atomic_block(connection)
    return not connection.get_autocommit()


class _Wake:
    """The ``on_commit`` callback that wakes this process's relays (one per transaction)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def __call__(self) -> None:
        self.callback()


class DjangoTransaction(DBAPITransaction):
    """:class:`~outbox_core.transaction.TransactionPort` over a Django connection.

    Per-transaction marks: Django gives a transaction no identity of its
    own, so every enqueue is treated as its transaction's first (see
    :mod:`outbox_core.ports.dbapi`): on PostgreSQL each carries the
    ``NOTIFY``, which PostgreSQL folds into one notification at commit.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        connection.ensure_connection()
        super().__init__(connection.connection)
        self.django = connection
        self._compiler = _compiler(self.driver_info)

    def autocommit(self) -> bool:
        """No transaction of the caller's is open (see :func:`in_transaction`)."""
        return not in_transaction(self.django)

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """On Django's cursor (a list of parameters: executemany)."""
        prepared = self._compiler.prepare(statement)
        with self.django.cursor() as cursor:
            if isinstance(parameters, list):
                cursor.executemany(prepared.sql, [prepared.parameters(p) for p in parameters])
            else:
                cursor.execute(prepared.sql, prepared.parameters(parameters))

    def execute_rowcount(self, statement: sa.Executable, parameters: dict[str, Any]) -> int:
        """Run ``statement`` once on Django's cursor; the rows it affected (the inbox's insert)."""
        prepared = self._compiler.prepare(statement)
        with self.django.cursor() as cursor:
            cursor.execute(prepared.sql, prepared.parameters(parameters))
            return int(cursor.rowcount)

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Once per transaction: ``on_commit`` in an atomic block, else the commit watch.

        Called only when relays run in this process. Django refuses
        ``on_commit`` outside atomic blocks (``set_autocommit(False)``): there
        the driver's transaction flag is watched, as for a plain DB-API
        connection.
        """
        conn = self.django
        if not conn.in_atomic_block:
            super().after_commit(callback)
            return
        if any(isinstance(entry[1], _Wake) for entry in conn.run_on_commit):
            return  # this transaction's wake-up is already registered
        transaction.on_commit(_Wake(callback), using=conn.alias)
