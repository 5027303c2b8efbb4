"""The throwaway source a log-tailing check reads (:func:`wal_feed`), and reading it.

The database's log tailing makes it
(:meth:`~outbox_core.relay.tailing.LogTailing.scratch`; PostgreSQL: a
publication and a logical replication slot named after the check's
temporary table; MySQL/MariaDB: the table's ``<table>_wal``, its progress
row at the binlog's end; dropped whatever happens, and those of dead verify
runs before) and it is read through the relay's own
:class:`~outbox_core.relay.tailing.LogReader`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from outbox_core.errors import OutboxError, UnsupportedDatabase
from outbox_core.relay.tailing import (
    LogReader,
    LogSource,
    LogTransaction,
    ScratchLeftBehind,
    ScratchSource,
    TailingUnavailable,
    log_tailing,
)
from outbox_core.verify.harness import Context
from outbox_core.verify.model import Failed, Skip

#: How long a check waits for transactions to come from the source.
READ_WITHIN = 15.0
#: How long the server may take to show a confirmed position on the source.
CONFIRM_WITHIN = 5.0


@dataclass
class WalFeed:
    """One check's temporary outbox table and its throwaway source."""

    ctx: Context
    scratch: ScratchSource
    #: The source as the checks' relay (named ``verify``) reads it.
    source: LogSource

    @property
    def dropped(self) -> list[str]:
        """Leftovers of dead verify runs dropped before this check."""
        return self.scratch.dropped

    def reader(self, *, status_interval: float = 10.0) -> LogReader:
        """A reader from the source's confirmed position (closed at the end)."""
        return self.scratch.reader(status_interval=status_interval)

    def read(
        self, reader: LogReader, count: int, within: float = READ_WITHIN
    ) -> list[LogTransaction]:
        """The next transactions until ``count`` events came (eventless ones passed over)."""
        got: list[LogTransaction] = []
        deadline = time.monotonic() + within
        while sum(len(t.events) for t in got) < count:
            remaining = deadline - time.monotonic()
            txn = reader.read(max(0.0, remaining))
            if txn is None:
                seen = sum(len(t.events) for t in got)
                raise Failed(f"{seen} of {count} events came from the slot within {within:.0f}s")
            if txn.events:
                got.append(txn)
        return got

    def more(self, reader: LogReader, wait: float = 0.5) -> list[LogTransaction]:
        """Transactions with events that come within ``wait`` s (there should be none)."""
        extra: list[LogTransaction] = []
        deadline = time.monotonic() + wait
        while (txn := reader.read(max(0.0, deadline - time.monotonic()))) is not None:
            if txn.events:
                extra.append(txn)
        return extra

    def confirmed(self) -> int:
        """The source's confirmed position as the server shows it (0 before any)."""
        try:
            return self.scratch.confirmed()
        except OutboxError as exc:  # the source is gone
            raise Failed(str(exc)) from exc

    def wait_confirmed(self, position: int, reader: LogReader | None = None) -> int:
        """The source's confirmed position once it reached ``position``, or after
        :data:`CONFIRM_WITHIN` s (answering the server on ``reader`` meanwhile)."""
        deadline = time.monotonic() + CONFIRM_WITHIN
        while (confirmed := self.confirmed()) < position and time.monotonic() < deadline:
            if reader is not None:
                reader.keep_alive()
            time.sleep(0.05)
        return confirmed

    def position(self) -> int:
        """The server's current log position."""
        return self.scratch.position()

    def describe(self, position: int) -> str:
        """A position as the database spells it."""
        return self.source.describe(position)


def event_ids(txns: Sequence[LogTransaction]) -> list[str]:
    """The event ids of the transactions' events, in stream order."""
    return [event.event_id for txn in txns for event, _ in txn.events]


@contextmanager
def wal_feed(ctx: Context) -> Iterator[WalFeed]:
    """The check's throwaway source of its temporary table; dropped after.

    Skips where log tailing cannot run; if the source cannot be dropped the
    check fails with what to run by hand.
    """
    try:
        tailing = log_tailing(ctx.dialect)
    except UnsupportedDatabase as exc:
        raise Skip(str(exc)) from None
    try:
        with tailing.scratch(ctx.outbox) as scratch:
            yield WalFeed(ctx, scratch, scratch.source("verify"))
    except TailingUnavailable as exc:
        raise Skip(str(exc)) from None
    except ScratchLeftBehind as exc:
        problem, left = exc.__cause__, str(exc)
        if problem is not None and not isinstance(problem, Skip):
            left = f"{problem}; and {left}"
        raise Failed(left) from problem


def noted(feed: WalFeed, line: str) -> str:
    """A check's result line, and the leftovers of dead runs it dropped."""
    if feed.dropped:
        line += (
            f" (dropped {len(feed.dropped)} abandoned verify slot(s): {', '.join(feed.dropped)})"
        )
    return line
