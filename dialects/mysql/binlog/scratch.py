"""A throwaway binlog source for ``outbox verify``'s log-tailing rows, removed whatever happens.

The binlog keeps no reader position (no slot): a source is its progress row
in ``<table>_wal``, which holds the confirmed GTID, and the named lock its
reader holds. Each check gets the usual temporary outbox table
(``outbox_verify_<random>``) plus its ``<table>_wal`` and the deferred rows'
index, as ``outbox install --source binlog`` makes them, the source named
after the table and started at the binlog's end; :func:`scratch_binlog`
drops ``<table>_wal`` in its ``finally`` whatever happened (the harness drops
the outbox table). The scratch source's readers write the progress row as
they confirm, as a relay's reports do, so what they confirm is what the next
reader starts after.

Several verify runs may share a server: every name is the check's own (the
reader lock ``GET_LOCK`` is per database and table), each binlog connection
has a random replica id, and while a check runs its guard connection holds a
named lock on the table's name. A ``outbox_verify_*_wal`` table in the
database whose lock is free is what a verify run that died left behind, and
the next check drops it (and says so).

Where log tailing cannot run (the binlog off, not ROW/FULL, no strict GTIDs,
missing replication privileges) :class:`~outbox_core.relay.tailing.TailingUnavailable`
says what to set.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Self

import sqlalchemy as sa

from outbox_core.dialects.base.tailing.scratch import Remembering, Scratch, scratch_source
from outbox_core.dialects.mysql.binlog.errors import BinlogError, ReaderLockHeld
from outbox_core.dialects.mysql.binlog.server import read_server
from outbox_core.dialects.mysql.binlog.source import BinlogReader, BinlogSource
from outbox_core.dialects.mysql.binlog.table import BinlogTable
from outbox_core.outbox import Outbox
from outbox_core.relay.tailing import LogStart, LogTransaction, TailingUnavailable

#: Prefix of the named lock a live check's guard connection holds on its table's name.
CHECK_LOCK_PREFIX = "outbox_verify:"
#: Exactly the progress tables of the names
#: :func:`~outbox_core.verify.harness.temporary_table` makes.
VERIFY_PROGRESS = re.compile(r"(outbox_verify_[0-9a-f]{10})_wal")
#: How long a new reader waits for a closed one's lock to be freed by the server.
REOPEN_WITHIN = 5.0
#: How long dropping ``<table>_wal`` may wait for a metadata lock before giving up.
DROP_LOCK_WAIT = 15


def check_lock(schema: str, name: str) -> str:
    """The named lock of a live check on ``schema.name`` (``GET_LOCK`` names are
    server-wide and at most 64 characters: the schema as a short digest)."""
    digest = hashlib.sha1(schema.encode(), usedforsecurity=False).hexdigest()[:12]
    return f"{CHECK_LOCK_PREFIX}{digest}.{name}"


def _try_lock(conn: sa.Connection, lock: str) -> bool:
    return bool(conn.execute(sa.text("SELECT GET_LOCK(:n, 0)"), {"n": lock}).scalar())


class ConfirmingReader:
    """A :class:`BinlogReader` whose confirms go to the progress row at once: the
    binlog keeps no position, so this is what the server shows and the next reader
    starts after (a relay writes the same row in its reports)."""

    def __init__(self, reader: BinlogReader, write: Callable[[int], None]) -> None:
        self.reader = reader
        self._write = write

    @property
    def started(self) -> LogStart:
        """What the server told before reading started."""
        return self.reader.started

    @property
    def start(self) -> int:
        """The GTID position reading started after."""
        return self.reader.start

    @property
    def confirmed(self) -> int:
        """The highest position confirmed (0 before any)."""
        return self.reader.confirmed

    @property
    def read_position(self) -> int:
        """The last transaction read."""
        return self.reader.read_position

    @property
    def idle_position(self) -> int | None:
        """None: every transaction is read and confirmed as it goes."""
        return self.reader.idle_position

    def read(self, timeout: float) -> LogTransaction | None:
        """The next committed transaction's events (None: none within ``timeout`` s)."""
        return self.reader.read(timeout)

    def keep_alive(self) -> None:
        """Check the reader's lock (the binlog connection needs nothing)."""
        self.reader.keep_alive()

    def confirm(self, position: int) -> None:
        """Everything up to ``position`` is handled: written to the progress row."""
        before = self.reader.confirmed
        self.reader.confirm(position)
        if self.reader.confirmed > before:
            self._write(self.reader.confirmed)

    def close(self) -> None:
        """End the binlog connection and free the reader's lock."""
        self.reader.close()


class ScratchBinlogSource(Remembering[BinlogReader], BinlogSource):
    """The scratch source: every reader it opens is closed with the scratch source."""

    def open(self, choose_start: Callable[[LogStart], int]) -> BinlogReader:
        """A reader, remembered for the teardown."""
        return self.remember(super().open(choose_start))


@dataclass
class ScratchBinlog(Scratch[BinlogReader]):
    """One check's temporary outbox table, its binlog source and the readers opened."""

    table: BinlogTable
    name: str

    @classmethod
    def begin(cls, outbox: Outbox, guard: sa.Connection) -> Self:
        """The source of ``outbox``'s temporary table once the binlog is found tailable
        (:func:`needs_log_tailing`); leftovers dropped, the check's lock held by ``guard``."""
        needs_log_tailing(guard)
        schema = outbox.table.schema or str(guard.execute(sa.text("SELECT DATABASE()")).scalar())
        guard.commit()
        dropped = drop_abandoned(guard, schema)
        # Held until <table>_wal is dropped: the mark of a live check for drop_abandoned.
        _try_lock(guard, check_lock(schema, outbox.table.name))
        guard.commit()
        table = BinlogTable(outbox.dialect)
        return cls(outbox, schema, table, outbox.table.name, dropped=dropped)

    def create(self, guard: sa.Connection) -> None:
        """``<table>_wal``, the source's progress row at the binlog's end."""
        self.table.install(guard)
        # Events committed from now on are the source's (as `install --source binlog`).
        self.write_confirmed(read_server(guard).end)
        guard.commit()  # no snapshot kept open: it would hold the tables' metadata locks

    def source(self, relay: str) -> ScratchBinlogSource:
        """The source as a relay named ``relay`` reads it."""
        return ScratchBinlogSource(
            self.outbox.engine, self.outbox.dialect, name=self.name, schema=self.schema,
            relay=relay, table=self.table, opened=self.opened,
        )  # fmt: skip

    def reader(self, *, status_interval: float = 10.0) -> ConfirmingReader:
        """A reader from the source's confirmed position (closed by :func:`scratch_binlog`).

        ``status_interval`` is not needed here: each confirm is written at once.
        """
        source = self.source("verify")
        deadline = time.monotonic() + REOPEN_WITHIN
        while True:
            try:
                made = source.open(lambda start: start.confirmed)
                break
            except ReaderLockHeld:
                # A reader just closed: the server frees its lock as the session ends.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return ConfirmingReader(made, self.write_confirmed)

    def write_confirmed(self, position: int) -> None:
        """The source's progress row: confirmed to ``position``."""
        with self.outbox.engine.connect() as conn:
            self.table.progress.report(
                conn, slot=self.name, relay="verify", confirmed_lsn=position, held=0,
                oldest_held_at=None,
            )  # fmt: skip
            conn.commit()  # the report joined the transaction its column check began

    def confirmed(self) -> int:
        """The source's confirmed GTID position, from its progress row (0 before any)."""
        with self.outbox.engine.connect() as conn:
            found = self.table.progress.settled(conn, self.name)
        return found or 0

    def position(self) -> int:
        """The binlog's end: what commits next lies past it."""
        with self.outbox.engine.connect() as conn:
            return read_server(conn).end

    def drop(self) -> str | None:
        """Drop ``<table>_wal``; None when it is gone, else what to run by hand."""
        progress = self.table.progress.table
        try:
            with self.outbox.engine.connect() as conn:
                # Not the server's default year: a session still holding the table fails here.
                conn.execute(sa.text(f"SET SESSION lock_wait_timeout = {DROP_LOCK_WAIT}"))
                progress.drop(conn, checkfirst=True)
                conn.commit()
            return None
        except (BinlogError, sa.exc.SQLAlchemyError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            return (
                f"dropping {progress.name} failed ({type(exc).__name__}: {first}); drop it by "
                f"hand: DROP TABLE `{self.schema}`.`{progress.name}`"
            )


def needs_log_tailing(conn: sa.Connection) -> None:
    """Raise :class:`TailingUnavailable`, with what to set, where the binlog cannot be
    tailed."""
    problems = read_server(conn).problems()
    if problems:
        raise TailingUnavailable("cannot tail the binlog: " + "; ".join(problems))


def drop_abandoned(conn: sa.Connection, schema: str) -> list[str]:
    """Drop the progress tables (``outbox_verify_*_wal``) verify runs that died left in
    ``schema``: those whose check lock is free (every live check holds its own from
    before it makes the table until after it dropped it; a session that dies frees it)
    and that hold no row but their own source's. The names dropped."""
    dropped = []
    found = sa.inspect(conn).get_table_names(schema=schema)
    conn.commit()
    for table in sorted(found):
        match = VERIFY_PROGRESS.fullmatch(table)
        if match is None:
            continue
        name = match.group(1)
        lock = check_lock(schema, name)
        if not _try_lock(conn, lock):
            continue  # a live check's
        try:
            quoted = conn.dialect.identifier_preparer.quote
            where = f"{quoted(schema)}.{quoted(table)}"
            slots = set(conn.execute(sa.text(f"SELECT slot FROM {where}")).scalars())
            conn.commit()
            if slots <= {name}:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {where}"))
                dropped.append(name)
        except sa.exc.DBAPIError:
            conn.rollback()  # not ours after all, or gone meanwhile: left alone
        finally:
            conn.execute(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": lock})
            conn.commit()
    return dropped


def scratch_binlog(outbox: Outbox) -> AbstractContextManager[ScratchBinlog]:
    """``<table>_wal`` of ``outbox``'s temporary table, its source at the binlog's end;
    dropped after.

    Raises :class:`TailingUnavailable` where log tailing cannot run
    (:func:`needs_log_tailing`). ``<table>_wal`` is dropped in ``finally``; if
    that fails too, :class:`ScratchLeftBehind` says how to drop it by hand.
    """
    return scratch_source(outbox, ScratchBinlog)
