"""The transaction port over Django's own connection, in its current atomic block.

It is the toolkit's DB-API port (:class:`~outbox_core.ports.DBAPITransaction`)
on the driver connection Django holds (``connections[alias].connection``):
statements compiled by SQLAlchemy for that driver run on it, inside the
atomic block the caller is in, so they roll back with it, savepoints
included. Transaction boundaries are Django's to know: "in a transaction"
is ``in_atomic_block``, wake-ups of this process's relays go through
``transaction.on_commit``, and the per-transaction wake-up mark is an
``on_commit`` marker, which Django itself drops when the savepoint or
transaction it was registered in rolls back.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from outbox_core.ports import DBAPITransaction
from outbox_core.ports.dbapi import compiler_for


class _Marker:
    """A no-op ``on_commit`` callback: pending while its transaction (or savepoint) lives."""

    def __call__(self) -> None:
        return None


class DjangoTransaction(DBAPITransaction):
    """:class:`~outbox_core.transaction.TransactionPort` over a Django connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        connection.ensure_connection()
        alias = connection.alias
        super().__init__(
            connection.connection,
            after_commit=lambda callback: transaction.on_commit(callback, using=alias),
        )
        self.django = connection

    def autocommit(self) -> bool:
        """Outside ``transaction.atomic()`` each statement would commit on its own."""
        return not self.django.in_atomic_block

    def first_event(self, owner: object) -> bool:
        """True once per transaction: while this transaction's marker is pending, False.

        Django drops the pending ``on_commit`` callbacks registered inside a
        savepoint it rolls back, and all of them when the transaction ends,
        so a marker still pending means the wake-up sent with it stands.
        """
        conn = self.django
        marks: dict[int, _Marker] = conn.__dict__.setdefault("_outbox_marks", {})
        marker = marks.get(id(owner))
        if marker is not None and any(entry[1] is marker for entry in conn.run_on_commit):
            return False
        marker = _Marker()
        transaction.on_commit(marker, using=conn.alias)
        marks[id(owner)] = marker
        return True

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """On the driver connection, unless Django marked the atomic block as broken."""
        # Django's own cursors refuse to run in a block whose error was caught
        # (needs_rollback); the raw connection would not.
        self.django.validate_no_broken_transaction()
        super().execute(statement, parameters)

    def execute_rowcount(self, statement: sa.Executable, parameters: dict[str, Any]) -> int:
        """Run ``statement`` once and return the rows it affected (the inbox's insert)."""
        self.django.validate_no_broken_transaction()
        prepared = compiler_for(self.driver_info).prepare(statement)
        cursor = self.connection.cursor()
        try:
            cursor.execute(prepared.sql, prepared.parameters(parameters))
            return int(cursor.rowcount)
        finally:
            cursor.close()
