"""MySQL/MariaDB's binlog as a log-tailing relay reads it: the outbox table's rows by GTID.

:class:`BinlogSource` is the :class:`~outbox_core.relay.tailing.LogSource`:
each reader holds the source's named lock (``GET_LOCK``: one reader at a
time, free the moment its connection closes, so a standby takes over within
about a second) and reads a :class:`~.stream.BinlogStream` from the GTID the
relay chooses. The binlog keeps no reader position: the confirmed position
lives in the progress row (``<table>_wal``), which ``install`` starts at the
binlog's end and the relay moves only past handled transactions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.tailing.deferred_rows import DEFERRED
from outbox_core.dialects.base.values import aware
from outbox_core.dialects.mysql.binlog.errors import (
    BinlogConnectionError,
    BinlogError,
    BinlogNotReady,
    BinlogPurged,
    ReaderLockHeld,
)
from outbox_core.dialects.mysql.binlog.names import lock_name
from outbox_core.dialects.mysql.binlog.server import (
    BinlogServer,
    lock_holder,
    purged_past,
    read_server,
    retention,
)
from outbox_core.dialects.mysql.binlog.stream import BinlogRow, BinlogStream, BinlogTransaction
from outbox_core.dialects.mysql.binlog.table import BinlogTable
from outbox_core.message import Event, State
from outbox_core.relay.tailing import LogStart, LogTransaction, SourceFacts

#: The reader checks it still holds the lock (and keeps its connection alive) this often.
LOCK_CHECK = 2.0


def _plain(value: Any) -> Any:
    """A decoded binary JSON value (MySQL: bytes keys and strings) as plain JSON values."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _json(value: Any) -> Any:
    """A JSON column's binlog value as the claim reads it: parsed."""
    if isinstance(value, bytes | str):
        return json.loads(value)
    return _plain(value)


def _utc(value: Any) -> datetime:
    """A ``DATETIME(6)`` (UTC, naive in the binlog) as an aware datetime."""
    return aware(value if isinstance(value, datetime) else datetime.fromisoformat(str(value)))


class RowEvents:
    """A transaction's rows as the relay's events: new pending rows, and replays."""

    def __init__(self, dialect: Dialect, token: str) -> None:
        self.dialect = dialect
        table = dialect.table
        self.names = [table.c[str(c.key)].name for c in dialect.claim_columns(table)]
        self.id_column = table.c.id.name
        self.available_column = table.c.available_at.name
        self.state_column = table.c.state.name
        self.owner_column = table.c.lease_owner.name
        self.token = token

    def event(self, values: Mapping[str, Any]) -> tuple[Event, datetime]:
        """An inserted row as :meth:`Dialect.to_event` builds it from a claim."""
        claimed = [values[name] for name in self.names]
        claimed[4], claimed[5] = _json(claimed[4]), _json(claimed[5])
        if isinstance(claimed[1], bytes):
            claimed[1] = claimed[1].decode("ascii")
        claimed[7] = _utc(claimed[7])
        event = self.dialect.to_event(claimed, self.token, attempts_offset=1)
        return event, _utc(values[self.available_column])

    def _new(self, row: BinlogRow) -> bool:
        """Pending, and not handed to the table by a relay (nor our dead-marking)."""
        values = row.values
        return values.get(self.state_column) == int(State.PENDING) and (
            values.get(self.owner_column) != DEFERRED
        )

    def transaction(self, txn: BinlogTransaction) -> LogTransaction:
        """The relay's view of ``txn``."""
        new = [r for r in txn.rows if self._new(r)]
        replays = [int(r.values[self.id_column]) for r in new if r.op == "update"]
        events = [self.event(r.values) for r in new if r.op == "insert"]
        return LogTransaction(txn.position, txn.position, txn.committed_at, events, replays)


class BinlogReader:
    """A :class:`BinlogStream` and the named lock, as a
    :class:`~outbox_core.relay.tailing.LogReader`."""

    def __init__(
        self,
        stream: BinlogStream,
        lock: sa.Connection,
        lock_id: str,
        started: LogStart,
        events: RowEvents,
    ) -> None:
        self.stream = stream
        self.lock = lock
        self.lock_id = lock_id
        self.events = events
        self._started = started
        self._confirmed = 0
        self._checked_at = time.monotonic()

    @property
    def started(self) -> LogStart:
        """What the server told before reading started."""
        return self._started

    @property
    def start(self) -> int:
        """The GTID position reading started after."""
        return self.stream.start

    @property
    def confirmed(self) -> int:
        """The highest position given to :meth:`confirm` (0 before any)."""
        return self._confirmed

    @property
    def read_position(self) -> int:
        """The last transaction read."""
        return self.stream.read_position

    @property
    def idle_position(self) -> int | None:
        """None: every transaction is read (empty ones too) and confirmed as it goes."""
        return None

    def read(self, timeout: float) -> LogTransaction | None:
        """The next committed transaction's events; checks the lock is still held."""
        self._check_lock()
        txn = self.stream.read(timeout)
        return None if txn is None else self.events.transaction(txn)

    def _check_lock(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < LOCK_CHECK:
            return
        self._checked_at = now
        try:
            mine = self.lock.execute(
                sa.text("SELECT IS_USED_LOCK(:n) = CONNECTION_ID()"), {"n": self.lock_id}
            ).scalar()
        except sa.exc.SQLAlchemyError as exc:
            raise BinlogConnectionError(f"the reader's lock connection is lost: {exc}") from exc
        if not mine:
            raise BinlogConnectionError("the reader's lock was lost: another relay may read")

    def keep_alive(self) -> None:
        """Keep the lock's connection alive (the binlog connection needs nothing)."""
        self._check_lock()

    def confirm(self, position: int) -> None:
        """Everything up to ``position`` is handled (the relay reports it in the progress row)."""
        self._confirmed = max(self._confirmed, position)

    def close(self) -> None:
        """End the binlog connection, then release the lock by closing its connection."""
        try:
            self.stream.close(killer=self._kill)
        finally:
            self.lock.invalidate()  # closes the connection: the server frees the lock
            self.lock.close()

    def _kill(self, thread_id: int) -> None:
        self.lock.execute(sa.text(f"KILL {int(thread_id)}"))


class BinlogSource:
    """The outbox table's rows in the server's binlog, from a GTID position."""

    kind = "binlog"
    noun = "binlog source"

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        *,
        name: str,
        schema: str,
        relay: str,
        table: BinlogTable | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.schema = schema
        self.table = table or BinlogTable(dialect)
        self.events = RowEvents(dialect, relay)
        self.lock_id = lock_name(schema, name)
        self._server: BinlogServer | None = None

    def open(self, choose_start: Callable[[LogStart], int]) -> BinlogReader:
        """Take the named lock, then read from where ``choose_start`` says."""
        conn = self.engine.connect()
        try:
            got = conn.execute(sa.text("SELECT GET_LOCK(:n, 0)"), {"n": self.lock_id}).scalar()
            if not got:
                raise ReaderLockHeld(f"another relay reads {self.name!r} (lock {self.lock_id!r})")
            conn.commit()
            server = self._server = read_server(conn)
            problems = server.problems()
            if problems:
                raise BinlogNotReady("; ".join(problems))
            confirmed = self.table.progress.settled(conn, self.name)
            if confirmed is None:
                raise BinlogError(
                    f"no position for {self.name!r} in {self.table.progress.table.name}: "
                    "`outbox install --source binlog` starts it at the binlog's end"
                )
            started = LogStart(self.name, server.history, server.end, confirmed)
            start = choose_start(started)
            why = purged_past(conn, server, start)
            if why is not None:
                raise BinlogPurged(why)
            conn.commit()
            stream = BinlogStream(
                self.engine.url, server, schema=self.schema, table=self.table.table.name,
                start=start,
            )  # fmt: skip
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        return BinlogReader(stream, conn, self.lock_id, started, self.events)

    def describe(self, position: int) -> str:
        """A position as the server spells its GTID."""
        server = self._server
        if server is None:
            return str(position)
        return server.describe(position)

    def distance(self, later: int, earlier: int) -> str:
        """Transactions between two positions."""
        server = self._server
        if server is None:
            return f"{later - earlier}"
        return f"{server.count(later) - server.count(earlier)} transaction(s)"

    def facts(self, conn: sa.Connection, server: BinlogServer | None = None) -> SourceFacts | None:
        """The source: its reader (the lock's holder), its confirmed position, the binlog
        the server keeps (``SHOW BINARY LOGS``) and the transactions committed past the
        position. No lag in bytes: a GTID is no offset. ``server``: already read."""
        confirmed = self.table.progress.settled(conn, self.name)
        if confirmed is None:
            return None
        holder = lock_holder(conn, self.lock_id)
        server = server or read_server(conn)
        try:
            retained: int | None = retention(conn).bytes
        except sa.exc.DBAPIError:  # no BINLOG MONITOR: the size is unknown, the rest stands
            conn.rollback()
            retained = None
        return SourceFacts(
            active=holder is not None,
            reader_pid=holder,
            confirmed=confirmed,
            lag_bytes=None,
            retained_bytes=retained,
            lag_transactions=server.count(server.end) - server.count(confirmed),
        )
