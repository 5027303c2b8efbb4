"""The transaction port: what ``enqueue`` needs from the caller's open transaction.

``enqueue`` is written once against :class:`TransactionPort`: run a statement
with its parameters in the caller's transaction, tell whether this is the
transaction's first event of an outbox (only that one carries the wake-up),
and run something once the transaction commits (wake this process's relays).
Any connection that can do those three things plugs in; this module holds
the SQLAlchemy implementation, which serves ``Connection``, ``Session``,
``AsyncConnection`` and ``AsyncSession`` however their transaction began.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from outbox_core.errors import ConfigurationError


class TransactionPort(Protocol):
    """The caller's open transaction, as ``enqueue`` uses it."""

    @property
    def driver(self) -> sa.Dialect:
        """The SQLAlchemy dialect that compiles statements for this connection."""

    @property
    def bind(self) -> Connection | None:
        """A SQLAlchemy connection to read the server's capabilities from, or None.

        None: the outbox reads them once on its own engine.
        """

    def autocommit(self) -> bool:
        """The connection commits each statement on its own (no transaction to join)."""

    def first_event(self, owner: object) -> bool:
        """True for the first call with ``owner`` in the current transaction, then False."""

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """Run ``statement`` in the caller's transaction (a list of parameters: executemany)."""

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the current transaction commits; forget it on rollback."""


class SQLAlchemyTransaction:
    """:class:`TransactionPort` over a SQLAlchemy ``Connection`` (a ``Session``'s included).

    A connection whose transaction begins on its first statement (``engine.connect()``
    then ``commit()``, SQLAlchemy's autobegin) is begun here, as that first
    statement would, so the transaction the marks refer to exists before the
    ``INSERT`` that carries the wake-up is chosen.
    """

    def __init__(self, conn: Connection, run: Callable[[sa.Executable, Any], Any]) -> None:
        self.conn = conn
        self._run = run

    @classmethod
    def of(cls, conn: Connection | Session, what: str) -> SQLAlchemyTransaction:
        """The port for ``conn``; ``what`` names the caller in the error for anything else."""
        if isinstance(conn, Connection):
            return cls(conn, conn.execute)
        if isinstance(conn, Session):
            # Statements go through the session (its events and flush rules apply).
            return cls(conn.connection(), conn.execute)
        raise ConfigurationError(
            f"{what} needs the Connection or Session of your transaction, "
            f"not {type(conn).__name__} (use enqueue_async for async ones)"
        )

    @property
    def driver(self) -> sa.Dialect:
        """The connection's dialect."""
        return self.conn.dialect

    @property
    def bind(self) -> Connection:
        """The connection itself."""
        return self.conn

    def autocommit(self) -> bool:
        """``isolation_level="AUTOCOMMIT"`` on the connection, or on the engine it came from."""
        # SQLAlchemy's own test covers both; it is not public API, so the
        # execution option (the connection's own setting) is the fallback.
        is_autocommit = getattr(self.conn, "_is_autocommit_isolation", None)
        if callable(is_autocommit):
            return bool(is_autocommit())
        return self.conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"

    def first_event(self, owner: object) -> bool:
        """Marks kept in ``conn.info`` per owner, each naming the transaction it was sent in.

        A rolled-back savepoint takes the wake-up sent inside it along: the
        marks are dropped then, so the next event sends it again (PostgreSQL
        folds repeats).
        """
        conn = self.conn
        tx = conn.get_transaction()
        if tx is None:
            tx = conn.begin()  # what the first statement's autobegin would do
        marks: dict[int, object] = conn.info.setdefault("outbox_marks", {})
        if marks.get(id(owner)) is tx:
            return False
        marks[id(owner)] = tx
        _hook(conn.engine, "rollback_savepoint", _forget_marks)
        return True

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """Through the connection or session the caller gave."""
        self._run(statement, parameters)

    def after_commit(self, callback: Callable[[], None]) -> None:
        """SQLAlchemy's engine-level ``commit`` event (it fires just before the database commit)."""
        self.conn.info.setdefault("outbox_after_commit", []).append(callback)
        _hook(self.conn.engine, "commit", _run_after_commit)
        _hook(self.conn.engine, "rollback", _drop_after_commit)


def _forget_marks(connection: Connection, name: str, context: object) -> None:
    connection.info.pop("outbox_marks", None)


def _run_after_commit(connection: Connection) -> None:
    for callback in connection.info.pop("outbox_after_commit", ()):
        callback()


def _drop_after_commit(connection: Connection) -> None:
    connection.info.pop("outbox_after_commit", None)


#: The engine events already listened to, per event name (each listener once per engine).
_HOOKED: dict[str, weakref.WeakSet[Engine]] = {}


def _hook(engine: Engine, event: str, listener: Callable[..., None]) -> None:
    hooked = _HOOKED.setdefault(event, weakref.WeakSet())
    if engine not in hooked:
        hooked.add(engine)
        sa.event.listen(engine, event, listener)
