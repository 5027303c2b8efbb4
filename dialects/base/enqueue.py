"""The statements ``enqueue`` runs, and the wake-ups that go with them (a part of Dialect).

Each family's part builds its own ``INSERT`` where it differs (PostgreSQL:
JSON bound as text, one array statement for ``enqueue_many``, NOTIFY folded
into the insert); the transaction port runs them in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.expression import (
    ReleaseSavepointClause,
    RollbackToSavepointClause,
    SavepointClause,
)

from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.storage import StorageRules
from outbox_core.dialects.base.values import Listener
from outbox_core.message import NewEvent, State
from outbox_core.partitions import partition_of


class EnqueueStatements:
    """What ``enqueue`` executes on one database family, and how relays are woken."""

    def __init__(self, sql: SqlPrimitives, storage: StorageRules) -> None:
        self.sql = sql
        self.table = sql.table
        #: Bind payload and headers as the JSON text ``enqueue`` already made
        #: (:attr:`StorageRules.json_as_text`).
        self.json_as_text = storage.json_as_text
        self._prepared: dict[tuple[bool, bool], sa.Executable] = {}
        #: False on a table an earlier version created, until ``outbox install``
        #: adds ``key_partition``: rows are written without it (NULL), which
        #: ordered relays read as "compute it from the key".
        self.with_partition = True

    def without_partition(self) -> None:
        """Write rows without ``key_partition`` (the table has no such column yet)."""
        self.with_partition = False
        self._prepared.clear()

    def with_wake_up(self, insert: Insert, *, notify: bool) -> sa.Executable:
        """Fold the wake-up into an enqueue ``INSERT`` where the database has one (PostgreSQL)."""
        return insert

    def json_bind(self, name: str) -> sa.ColumnElement[Any]:
        """A bound JSON value of the enqueue ``INSERT``.

        Where :attr:`json_as_text` is set, the value bound is the JSON text
        ``enqueue`` already made while checking the payload (not serialised
        a second time).
        """
        if self.json_as_text:
            return sa.bindparam(name, type_=sa.UnicodeText())
        return sa.bindparam(name, type_=self.table.c.payload.type)

    def prepared_insert(self, *, headers: bool, delay: float = 0.0) -> Insert:
        """The enqueue ``INSERT``, its event's values as bound parameters.

        Parameters are named ``o_<column>`` (see :meth:`enqueue_call`). Without
        ``headers`` the column is NULL. A ``delay`` goes into the statement
        (``available_at`` from the database clock).
        """
        t = self.table
        now = self.sql.clock()
        # inline(): no implicit RETURNING id, which enqueue never reads.
        return (
            sa.insert(t)
            .inline()
            .values(
                event_id=sa.bindparam("o_event_id", type_=t.c.event_id.type),
                topic=sa.bindparam("o_topic", type_=t.c.topic.type),
                key=sa.bindparam("o_key", type_=t.c.key.type),
                payload=self.json_bind("o_payload"),
                headers=self.json_bind("o_headers") if headers else sa.null(),
                state=int(State.PENDING),
                attempts=0,
                available_at=self.sql.after(delay) if delay else now,
                created_at=now,
                **(
                    {"key_partition": sa.bindparam("o_key_partition", type_=t.c.key_partition.type)}
                    if self.with_partition
                    else {}
                ),
            )
        )

    def call(self, event: NewEvent, *, notify: bool) -> tuple[sa.Executable, dict[str, Any]]:
        """What ``enqueue`` executes for ``event``: a statement and its parameters.

        Undelayed events (nearly all) reuse a statement built once: building a
        fresh one per event, and computing its cache key, costs more than the
        database's own work on the insert (``bench/producer_overhead.py``).
        A delayed event's statement carries its delay and is built per call.
        """
        headers = event.headers is not None
        if event.delay_seconds:
            insert = self.prepared_insert(headers=headers, delay=event.delay_seconds)
            stmt = self.with_wake_up(insert, notify=notify)
        else:
            cached = self._prepared.get((notify, headers))
            if cached is None:
                insert = self.prepared_insert(headers=headers)
                cached = self._prepared[notify, headers] = self.with_wake_up(insert, notify=notify)
            stmt = cached
        as_text = self.json_as_text
        params: dict[str, Any] = {
            "o_event_id": event.event_id,
            "o_topic": event.topic,
            "o_key": event.key,
            "o_payload": event.payload_json if as_text else event.payload,
        }
        if headers:
            params["o_headers"] = event.headers_json if as_text else event.headers
        if self.with_partition:
            params["o_key_partition"] = partition_of(event.key, event.event_id)
        params.update(self.sql.clock_params())
        return stmt, params

    def many_calls(
        self, events: Sequence[NewEvent], *, notify: bool, driver: sa.Dialect
    ) -> Iterator[tuple[sa.Executable, Any]]:
        """What ``enqueue_many`` executes: ``(statement, parameters)`` pairs, in order.

        The first event goes alone, carrying the wake-up. The others go as
        executemany of :meth:`enqueue`'s own prepared statement, one per run
        of events of the same shape (with or without headers, the same
        delay), so rows are written, and get their ids, in the order given.
        SQLAlchemy's "insertmanyvalues" folds each executemany into multi-row
        ``INSERT`` statements: on ``driver``\'s own where it does so without
        ``RETURNING`` (SQL Server, whose ``OUTPUT`` a trigger would break),
        else through ``RETURNING id`` where the server has it (PostgreSQL,
        SQLite, MariaDB). MySQL has neither: there PyMySQL sends the rows one
        by one.
        """
        if not events:
            return
        yield self.call(events[0], notify=notify)
        fold = driver.insert_executemany_returning and not driver.use_insertmanyvalues_wo_returning
        run: list[dict[str, Any]] = []
        shape: tuple[bool, float] | None = None
        stmt: sa.Executable | None = None
        for event in events[1:]:
            this = (event.headers is not None, event.delay_seconds)
            if this != shape and run:
                assert stmt is not None
                yield stmt, run
                run = []
            next_stmt, params = self.call(event, notify=False)
            if this != shape:
                # RETURNING makes SQLAlchemy fold the executemany into
                # multi-row INSERTs ("insertmanyvalues") on every driver.
                assert isinstance(next_stmt, sa.Insert)
                shape, stmt = this, next_stmt
                if fold:
                    stmt = next_stmt.returning(self.table.c.id)
            run.append(params)
        if run:
            assert stmt is not None
            yield stmt, run

    # -- the caller's own event ids ----------------------------------------------------------
    #
    # An event whose id the caller gave may meet a row that already holds it.
    # Its insert runs inside a savepoint of the caller's transaction, so that
    # a duplicate (which aborts a whole transaction on PostgreSQL, and which
    # a multi-statement enqueue_many would leave half written anywhere) is
    # undone alone. Generated ids (nearly all events) never go through here.

    #: The name of the savepoint the guarded inserts run in.
    SAVEPOINT = "outbox_event_id"

    def guard_begin(self) -> list[sa.Executable]:
        """Run before the guarded inserts: the savepoint (and whatever it needs first)."""
        return [SavepointClause(self.SAVEPOINT)]  # type: ignore[no-untyped-call]

    def guard_end(self) -> list[sa.Executable]:
        """Run after the guarded inserts succeeded: the savepoint released."""
        return [ReleaseSavepointClause(self.SAVEPOINT)]  # type: ignore[no-untyped-call]

    def guard_undo(self) -> list[sa.Executable]:
        """Run after a guarded insert failed: back to the savepoint (the transaction usable)."""
        undo = RollbackToSavepointClause(self.SAVEPOINT)  # type: ignore[no-untyped-call]
        return [undo, *self.guard_end()]

    def duplicate_event_id(self, error: BaseException, event_ids: Sequence[str]) -> str | None:
        """Whether ``error`` is a guarded insert meeting an ``event_id`` already in the table.

        Returns the id the database named (one of ``event_ids``), ``""`` for a
        duplicate whose id it did not name, ``None`` for any other error.
        ``error`` is the driver's own or SQLAlchemy's wrapper of it. A
        unique violation counts when its text (with the server's detail)
        names the event id column's unique index or holds one of the ids:
        no other column holds a UUID the caller gave.
        """
        text = error_text(error).lower()
        if "duplicate" not in text and "unique" not in text:
            return None
        for event_id in event_ids:
            if event_id in text:
                return event_id
        if any(name in text for name in self.event_id_index_names()):
            return ""
        return None

    def event_id_index_names(self) -> list[str]:
        """How errors name the unique index on ``event_id`` (lower-case).

        The index's name, and ``table.column`` (SQLite's ``UNIQUE constraint
        failed: outbox.event_id``).
        """
        column = self.table.c.event_id
        names = [
            str(index.name).lower()
            for index in self.table.indexes
            if index.unique and list(index.columns) == [column] and index.name
        ]
        return [*names, f"{self.table.name}.{column.name}".lower()]

    def notify_channel(self) -> str:
        """The channel relays of this table listen on (databases with NOTIFY)."""
        t = self.table
        name = t.name if t.schema is None else f"{t.schema}_{t.name}"
        return f"outbox_{name}"[:63]

    def notify_statement(self) -> sa.Executable | None:
        """A statement, run in the producer's transaction, that wakes relays at commit.

        ``None`` where the database has no such thing: relays poll.
        """
        return None

    def listener(self, engine: Engine, channels: Sequence[str] = ()) -> Listener | None:
        """A connection that waits for :meth:`notify_statement` wake-ups (None: poll).

        On this table's channel, or on ``channels`` (a relay of many outboxes
        listens on all of theirs on one connection).
        """
        return None


def error_text(error: BaseException) -> str:
    """The text of the driver's error under ``error``, with the server's detail.

    asyncpg and psycopg keep the server's ``DETAIL`` line (PostgreSQL's
    ``Key (event_id)=(...) already exists``) beside the message.
    """
    parts: list[str] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        orig = getattr(exc, "orig", None)
        if not isinstance(orig, BaseException):
            # SQLAlchemy's wrapper is left out: its text holds the statement's
            # parameters, every id of the batch.
            parts.append(str(exc))
        for name in ("detail", "constraint_name"):
            value = getattr(exc, name, None)
            if isinstance(value, str):
                parts.append(value)
        diag = getattr(exc, "diag", None)
        for name in ("message_detail", "constraint_name"):
            value = getattr(diag, name, None)
            if isinstance(value, str):
                parts.append(value)
        stack += [orig if isinstance(orig, BaseException) else None, exc.__cause__]
    return "\n".join(parts)
