"""PostgreSQL's log as a log-tailing relay reads it: a logical slot of the outbox table.

:class:`SlotSource` is PostgreSQL's
:class:`~outbox_core.relay.tailing.LogSource`: each reader is a
:class:`~.stream.WalStream` of the slot, whose transactions'
rows become the relay's events here (the dialect's own ``claim_columns`` /
``to_event``, fed from the log's text values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.tailing.deferred_rows import DEFERRED
from outbox_core.dialects.postgresql.wal.names import format_lsn, wal_distance
from outbox_core.dialects.postgresql.wal.pgoutput import load_text
from outbox_core.dialects.postgresql.wal.rows import StreamStart, WalRow, WalTransaction
from outbox_core.dialects.postgresql.wal.stream import WalStream
from outbox_core.dialects.postgresql.wal.table import WalTable, slot_source_facts
from outbox_core.message import Event, State
from outbox_core.relay.tailing import LogStart, LogTransaction, SourceFacts


def log_start(start: StreamStart) -> LogStart:
    """What the server told a :class:`WalStream`, as the relay reads it."""
    return LogStart(
        source=start.slot,
        history=f"{start.system_id}/{start.timeline}",
        end=start.flush_lsn,
        confirmed=start.slot_lsn,
    )


class RowEvents:
    """A transaction's rows as the relay's events: new pending rows, and replays."""

    def __init__(self, dialect: Dialect, token: str) -> None:
        self.dialect = dialect
        table = dialect.table
        # The log names a row's columns as the table does (``aggregate_id`` of an
        # adopted table); a claim column's key is its field (``key``).
        self.columns = [
            (table.c[str(c.key)].name, isinstance(c.type, sa.Text))
            for c in dialect.claim_columns(table)
        ]
        #: The log's names of the ordering column and of ``available_at``.
        self.id_column = table.c.id.name
        self.available_column = table.c.available_at.name
        self.token = token

    def event(self, row: WalRow) -> tuple[Event, datetime]:
        """An inserted row as :meth:`Dialect.to_event` builds it from a claim, and its
        ``available_at``.

        Columns the dialect reads as text (``event_id``, ``payload``,
        ``headers``) keep the log's text; the others are loaded by type oid.
        """
        values, oids = row.values, row.type_oids
        claimed = [
            values[name] if as_text else load_text(values[name], oids[name])
            for name, as_text in self.columns
        ]
        # attempts_offset 1: the event carries its attempt number, as a claim's does.
        event = self.dialect.to_event(claimed, self.token, attempts_offset=1)
        available = self.available_column
        return event, load_text(values[available], oids[available])

    def transaction(self, txn: WalTransaction) -> LogTransaction:
        """The relay's view of ``txn``."""
        # Rows a relay handed to the table (and its updates of them) are not new events.
        pending = [r for r in txn.rows if is_pending(r) and not handed_over(r)]
        # Our own dead-marking (state DEAD) is in the log too: only a return to pending counts.
        replays = [int(str(r.values[self.id_column])) for r in pending if r.op == "update"]
        events = [self.event(r) for r in pending if r.op == "insert"]
        return LogTransaction(txn.end_lsn, txn.commit_lsn, txn.commit_time, events, replays)


def is_pending(row: WalRow) -> bool:
    """The row's (new) state is pending: an enqueued row, or a replayed one."""
    return row.values.get("state") == str(int(State.PENDING))


def handed_over(row: WalRow) -> bool:
    """The row was handed to the table by a relay (its insert or update is in the log)."""
    return row.values.get("lease_owner") == DEFERRED


class SlotReader:
    """A :class:`WalStream` as a :class:`~outbox_core.relay.tailing.LogReader`."""

    def __init__(self, stream: WalStream, events: RowEvents) -> None:
        self.stream = stream
        self.events = events
        assert stream.started is not None  # set by the constructor, or it raised
        self._started = log_start(stream.started)

    @property
    def started(self) -> LogStart:
        """What the server told before reading started."""
        return self._started

    @property
    def start(self) -> int:
        """:attr:`WalStream.start_lsn`."""
        return self.stream.start_lsn

    @property
    def confirmed(self) -> int:
        """:attr:`WalStream.confirmed_lsn`."""
        return self.stream.confirmed_lsn

    @property
    def read_position(self) -> int:
        """:attr:`WalStream.read_lsn`."""
        return self.stream.read_lsn

    @property
    def idle_position(self) -> int | None:
        """:attr:`WalStream.idle_lsn`."""
        return self.stream.idle_lsn

    def read(self, timeout: float) -> LogTransaction | None:
        """The next committed transaction's events (:meth:`WalStream.read`)."""
        txn = self.stream.read(timeout)
        return None if txn is None else self.events.transaction(txn)

    def keep_alive(self) -> None:
        """:meth:`WalStream.keep_alive`."""
        self.stream.keep_alive()

    def confirm(self, position: int) -> None:
        """:meth:`WalStream.confirm`."""
        self.stream.confirm(position)

    def close(self) -> None:
        """:meth:`WalStream.close`: the server releases the slot as the walsender exits."""
        self.stream.close()


class SlotSource:
    """A logical replication slot (plugin ``pgoutput``) of the outbox table's publication."""

    kind = "wal"
    noun = "slot"

    def __init__(
        self,
        url: str | sa.URL,
        dialect: Dialect,
        *,
        slot: str,
        publication: str,
        tables: Iterable[tuple[str, str]],
        relay: str,
        table: WalTable | None = None,
        **stream_options: Any,
    ) -> None:
        self.url = url
        self.name = slot
        self.publication = publication
        self.tables: Sequence[tuple[str, str]] = list(tables)
        self.table = table or WalTable(dialect)
        self.events = RowEvents(dialect, relay)
        #: Passed on to each :class:`WalStream` (``application_name``, timeouts...).
        self.stream_options = stream_options

    def stream(self, **options: Any) -> WalStream:
        """A new :class:`WalStream` of the slot (``options`` over the source's own)."""
        return WalStream(
            self.url,
            slot=self.name,
            publication=self.publication,
            tables=self.tables,
            **{**self.stream_options, **options},
        )

    def open(self, choose_start: Callable[[LogStart], int]) -> SlotReader:
        """A reader of the slot, starting where ``choose_start`` says."""
        stream = self.stream(choose_start=lambda start: choose_start(log_start(start)))
        return SlotReader(stream, self.events)

    def describe(self, position: int) -> str:
        """An LSN as PostgreSQL spells it."""
        return format_lsn(position)

    def distance(self, later: int, earlier: int) -> str:
        """WAL bytes between two LSNs."""
        return wal_distance(later - earlier)

    def facts(self, conn: sa.Connection) -> SourceFacts | None:
        """The slot as ``pg_replication_slots`` shows it."""
        return slot_source_facts(conn, self.name)
