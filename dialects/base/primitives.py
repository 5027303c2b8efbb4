"""What a dialect's parts build their statements from: the tables, the clock, transactions,
row locks, id lists and the claimed rows' columns.

A :class:`~outbox_core.dialects.base.dialect.Dialect` builds one
:class:`SqlPrimitives` from its own operations and hands it to each of its
parts (``enqueue``, ``inbox``, ``reads``, ``keys``, ``partitions``,
``settle``). A part holds these few operations, never the dialect: what a
family changes (its clock, its row-lock hints, PostgreSQL's array of ids)
reaches every part through them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.message import Event
from outbox_core.schema import OutboxTables


class LeaseValues(Protocol):
    """:meth:`Dialect.lease_values`: the SET clause that leases a pending row."""

    def __call__(
        self,
        *,
        lease: float,
        token: str | sa.BindParameter[str],
        target: sa.FromClause | None = None,
    ) -> dict[str, Any]:
        """The values that turn a pending row of ``target`` into one leased under ``token``."""


class Owned(Protocol):
    """:meth:`Dialect.owned`: the rows among some ids a claim token still holds."""

    def __call__(
        self, ids: Sequence[int], token: str, *, or_dead: bool = False
    ) -> sa.ColumnElement[bool]:
        """Rows among ``ids`` still held by ``token`` (``or_dead``: or made dead under it)."""


class ToEvent(Protocol):
    """:meth:`Dialect.to_event`: an :class:`Event` from a row of the claim's columns."""

    def __call__(self, row: Sequence[Any], token: str, attempts_offset: int = 0) -> Event:
        """The event of ``row``, claimed under ``token``."""


@dataclass(frozen=True)
class SqlPrimitives:
    """The operations of a dialect its parts build on; each is the dialect's own method."""

    #: The outbox, inbox and membership tables.
    tables: OutboxTables
    #: The database's current UTC time as a SQL expression.
    now: Callable[[], sa.ColumnElement[datetime]]
    #: The database's current UTC time plus some seconds (may be negative).
    after: Callable[[float], sa.ColumnElement[datetime]]
    #: ``now`` for statements built once and run many times (the application's
    #: clock is then a bound parameter, given by ``clock_params`` at execution).
    clock: Callable[[], sa.ColumnElement[datetime]]
    #: The parameters ``clock`` needs at execution.
    clock_params: Callable[[], dict[str, Any]]
    #: Open and commit a short transaction, or join the caller's open one.
    transaction: Callable[[Connection], AbstractContextManager[Connection]]
    #: Lock the rows a select picks, skipping rows other claims hold.
    lock_rows: Callable[[sa.Select[Any]], sa.Select[Any]]
    #: ``id IN (...)`` of the outbox table.
    id_in: Callable[[Sequence[int]], sa.ColumnElement[bool]]
    #: ``id IN (:o_ids)``, the ids bound at execution.
    id_in_bound: Callable[[], sa.ColumnElement[bool]]
    #: The most ids one statement binds.
    max_batch: int
    #: The rows among some ids a claim token still holds.
    owned: Owned
    #: The columns a claim returns, in ``to_event`` order.
    claim_columns: Callable[[sa.FromClause], list[sa.ColumnElement[Any]]]
    #: An :class:`Event` from a row of ``claim_columns``.
    to_event: ToEvent
    #: The SET clause that leases a pending row.
    lease_values: LeaseValues
    #: The bytes of a row's payload and headers as the database stores them.
    stored_size: Callable[[sa.FromClause], sa.ColumnElement[int]]

    @property
    def table(self) -> sa.Table:
        """The outbox table."""
        return self.tables.outbox


@contextmanager
def plain_read(conn: Connection) -> Iterator[Connection]:
    """A plain read transaction, or the caller's open one (no row lock, no write lock).

    Not :attr:`SqlPrimitives.transaction`: SQLite's takes the write lock at
    ``BEGIN``, which relays and producers would wait on.
    """
    if conn.in_transaction():
        yield conn
        return
    with conn.begin():
        yield conn
