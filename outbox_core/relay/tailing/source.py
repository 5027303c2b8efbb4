"""What a log-tailing relay reads: a database's log of committed transactions.

A :class:`LogSource` is one database's log as the relay sees it
(PostgreSQL: a logical replication slot and its publication). It opens a
:class:`LogReader`, which hands out whole committed transactions in commit
order (:class:`LogTransaction`) and moves the source's confirmed position
when told (:meth:`LogReader.confirm`): whatever was not confirmed is read
again by the next reader (at least once).

Positions are ordered integers the source defines (PostgreSQL: an LSN); the
relay only compares them, stores them and has the source spell them
(:meth:`LogSource.describe`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

import sqlalchemy as sa

from outbox_core.errors import OutboxError
from outbox_core.message import Event

if TYPE_CHECKING:
    from outbox_core.dialects.base.tailing.table import LogTable


class SourceInUse(OutboxError):
    """Another reader has the source: a standby waits and tries again."""

    transient = True


@dataclass(frozen=True)
class LogStart:
    """What the server told a reader before it started reading.

    ``history`` names the log's history (PostgreSQL: system id and
    timeline): a position from another history means nothing here. ``end``
    is the log flushed so far (nothing committed lies beyond it);
    ``confirmed`` the source's confirmed position as the server kept it
    (after a crash it may be older than what was confirmed).
    """

    source: str
    history: str
    end: int
    confirmed: int


@dataclass(frozen=True)
class LogTransaction:
    """One committed transaction, as the relay takes it in.

    ``events`` are the outbox rows it inserted (pending, and not handed to
    the table by a relay), each with its ``available_at``; ``replayed`` the
    ids of rows ``outbox replay`` set pending again, to read back from the
    table. Both may be empty: confirming ``end`` then only frees the log.
    """

    #: The position to confirm once every event is handled.
    end: int
    #: Where it committed: a reader that starts past it never gets it.
    commit: int
    committed_at: datetime
    events: Sequence[tuple[Event, datetime]]
    replayed: Sequence[int] = ()


class LogReader(Protocol):
    """One connection reading a source from a start position (one thread at a time).

    After any error the reader is done: close it and open another, which
    starts again from the source's confirmed position.
    """

    @property
    def started(self) -> LogStart:
        """What the server told before reading started."""

    @property
    def start(self) -> int:
        """Where reading started: no transaction that committed before it comes."""

    @property
    def confirmed(self) -> int:
        """The highest position given to :meth:`confirm` (0 before any)."""

    @property
    def read_position(self) -> int:
        """How far the server's log has been read (for status)."""

    @property
    def idle_position(self) -> int | None:
        """The server's log end when nothing read is left unconfirmed, else None.

        Confirming it lets the source drop log nobody watches.
        """

    def read(self, timeout: float) -> LogTransaction | None:
        """The next committed transaction, or None if none came within ``timeout`` s."""

    def keep_alive(self) -> None:
        """Answer the server without waiting (while the relay cannot read on)."""

    def confirm(self, position: int) -> None:
        """Everything up to ``position`` (a transaction's ``end``) is handled."""

    def close(self) -> None:
        """Close the connection; the source is free for another reader."""


@dataclass(frozen=True)
class SourceFacts:
    """A source as the server shows it (PostgreSQL: ``pg_replication_slots``)."""

    #: A reader has it.
    active: bool
    #: The reader's server process.
    reader_pid: int | None
    #: Its confirmed position as the server keeps it.
    confirmed: int | None
    #: Log written since the confirmed position (None where positions are no offsets).
    lag_bytes: int | None
    #: Log the server keeps on its disk for it.
    retained_bytes: int | None
    #: Transactions committed since the confirmed position, where the log counts them
    #: (MySQL/MariaDB: GTIDs).
    lag_transactions: int | None = None


class LogSource(Protocol):
    """A database's log for one outbox table, as a log-tailing relay reads it."""

    #: The source's name (PostgreSQL: the slot): the progress row's key.
    name: str
    #: What log lines call the relay and its source: ``wal`` and ``slot``, ``binlog``
    #: and ``binlog source``.
    kind: str
    noun: str

    @property
    def table(self) -> LogTable:
        """The outbox table's statements for log tailing (dead, deferred, progress rows)."""

    def open(self, choose_start: Callable[[LogStart], int]) -> LogReader:
        """Connect and start reading where ``choose_start`` says.

        Raises :class:`SourceInUse` while another reader has the source, and
        :class:`~outbox_core.errors.DatabaseError` when the server cannot be
        reached.
        """

    def describe(self, position: int) -> str:
        """A position as the database spells it (PostgreSQL: ``16/B374D848``)."""

    def distance(self, later: int, earlier: int) -> str:
        """How far apart two positions are, for a log line."""

    def facts(self, conn: sa.Connection) -> SourceFacts | None:
        """The source as the server shows it (None: it does not exist)."""
