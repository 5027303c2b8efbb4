"""Reading the binlog: whole committed transactions of the outbox table, in commit order.

:class:`BinlogStream` runs python-mysql-replication's ``BinLogStreamReader``
(a replica's ``COM_BINLOG_DUMP`` from a GTID) on a thread of its own, which
gathers each transaction's rows of the outbox table between its GTID event
and its commit (``XID``, or a ``COMMIT``/DDL query) and queues it: the relay
reads with a timeout, which the library's blocking reads cannot give.
Transactions that touched other tables come too, without rows: confirming
them moves the relay's position on.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pymysql
from pymysqlreplication import BinLogStreamReader  # type: ignore[import-untyped]
from pymysqlreplication.event import GtidEvent, MariadbGtidEvent, QueryEvent, XidEvent  # type: ignore[import-untyped]
from pymysqlreplication.row_event import UpdateRowsEvent, WriteRowsEvent  # type: ignore[import-untyped]

from outbox_core.dialects.mysql.binlog.errors import BinlogConnectionError, BinlogPurged
from outbox_core.dialects.mysql.binlog.names import mariadb_position
from outbox_core.dialects.mysql.binlog.server import BinlogServer
from outbox_core.errors import OutboxError

log = logging.getLogger("outbox.relay")

#: Transactions read ahead of the relay; the reading thread waits beyond this.
READ_AHEAD = 256
#: The server sends a heartbeat this often while idle; a silent connection is dead after
#: READ_TIMEOUT.
HEARTBEAT = 2.0
READ_TIMEOUT = 30
#: MySQL/MariaDB error 1236: the replica's position is not in the binlog (purged).
ER_MASTER_FATAL_READING_BINLOG = 1236


#: The events that begin and end a transaction.
BOUNDARIES = (GtidEvent, MariadbGtidEvent, QueryEvent, XidEvent)


@dataclass(frozen=True)
class BinlogRow:
    """One row of the outbox table: ``insert`` or ``update`` (its values after)."""

    op: str
    values: Mapping[str, Any] = field(hash=False)


@dataclass(frozen=True)
class BinlogTransaction:
    """One committed transaction: its GTID position, commit time and outbox rows."""

    position: int
    committed_at: datetime
    rows: tuple[BinlogRow, ...]


@dataclass
class _Open:
    position: int
    rows: list[BinlogRow] = field(default_factory=list)


def connect_args(url: Any) -> dict[str, Any]:
    """PyMySQL's connection arguments of a SQLAlchemy URL."""
    return {
        "host": url.host or "127.0.0.1",
        "port": int(url.port or 3306),
        "user": url.username or "root",
        "passwd": url.password or "",
        "charset": "utf8mb4",
        "read_timeout": READ_TIMEOUT,
    }


class BinlogStream:
    """A binlog connection from a GTID, its transactions queued by a thread of its own."""

    def __init__(
        self, url: Any, server: BinlogServer, *, schema: str, table: str, start: int
    ) -> None:
        self.server = server
        self.schema = schema
        self.table = table
        self.start = start
        #: The last transaction's position taken by :meth:`read`.
        self.read_position = start
        self._queue: queue.Queue[BinlogTransaction | BaseException] = queue.Queue(READ_AHEAD)
        self._connections: list[pymysql.connections.Connection] = []
        self._closing = threading.Event()
        args = connect_args(url)
        self._reader = BinLogStreamReader(
            connection_settings=args,
            # A replica's id of its own: a second dump with the same id would end this one.
            server_id=random.randint(1 << 20, (1 << 31) - 1),
            blocking=True,
            is_mariadb=server.mariadb,
            auto_position=server.start_gtid(start) if server.mariadb else self._mysql_set(start),
            only_events=[*BOUNDARIES, WriteRowsEvent, UpdateRowsEvent],
            only_schemas=[schema],
            only_tables=[table],
            slave_heartbeat=HEARTBEAT,
            pymysql_wrapper=self._connect,
        )
        self._thread = threading.Thread(target=self._run, name="binlog-reader", daemon=True)
        self._thread.start()

    def _mysql_set(self, start: int) -> str:
        return f"{self.server.origin}:1-{start}" if start else ""

    def _connect(self, **kwargs: Any) -> pymysql.connections.Connection:
        conn = pymysql.connect(**kwargs)
        self._connections.append(conn)
        return conn

    # -- the reading thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._gather()
        except BaseException as exc:  # handed to the relay's thread, which raises it
            if not self._closing.is_set():
                self._put(exc)

    def _put(self, item: BinlogTransaction | BaseException) -> None:
        while not self._closing.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _gather(self) -> None:
        current: _Open | None = None
        last = self.start
        for event in self._reader:
            if self._closing.is_set():
                return
            if isinstance(event, MariadbGtidEvent | GtidEvent):
                position = self._position(event)
                if position is not None and self.server.count(position) <= self.server.count(last):
                    # The library reconnected from its first position on its own:
                    # this reader's stream is no longer what the relay confirms.
                    raise BinlogConnectionError("the binlog connection restarted")
                current = None if position is None else _Open(position)
            elif isinstance(event, WriteRowsEvent | UpdateRowsEvent) and current is not None:
                current.rows.extend(self._rows(event))
            elif isinstance(event, XidEvent) or (
                isinstance(event, QueryEvent) and str(event.query).strip().upper() != "BEGIN"
            ):
                if current is None:
                    continue
                when = datetime.fromtimestamp(event.timestamp, UTC)
                self._put(BinlogTransaction(current.position, when, tuple(current.rows)))
                last, current = current.position, None

    def _position(self, event: Any) -> int | None:
        """The event's GTID as a position (None: another domain or server's, skipped)."""
        if isinstance(event, MariadbGtidEvent):
            if event.domain_id != self.server.domain:
                return None
            return mariadb_position(int(event.server_id), int(event.gtid_seq_no))
        uuid, _, number = str(event.gtid).partition(":")
        return int(number) if uuid.lower() == self.server.origin.lower() else None

    @staticmethod
    def _rows(event: Any) -> list[BinlogRow]:
        if isinstance(event, WriteRowsEvent):
            return [BinlogRow("insert", row["values"]) for row in event.rows]
        return [BinlogRow("update", row["after_values"]) for row in event.rows]

    # -- the relay's thread --------------------------------------------------------------

    def read(self, timeout: float) -> BinlogTransaction | None:
        """The next committed transaction, or None if none came within ``timeout`` s."""
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            if not self._thread.is_alive() and self._queue.empty():
                raise BinlogConnectionError("the binlog reader stopped") from None
            return None
        if isinstance(item, BaseException):
            raise _as_error(item)
        self.read_position = item.position
        return item

    def close(self, killer: Any | None = None) -> None:
        """Stop the reading thread: ``killer(thread_id)`` ends its connections on the
        server (a blocked read wakes up), then the library closes them."""
        self._closing.set()
        if killer is not None:
            for conn in list(self._connections):
                try:
                    killer(conn.thread_id())
                except Exception:  # already gone
                    log.debug("binlog connection already closed", exc_info=True)
        self._thread.join(timeout=5)
        try:
            self._reader.close()
        except Exception:
            log.debug("closing the binlog reader", exc_info=True)


def _as_error(exc: BaseException) -> BaseException:
    """The reading thread's failure as the relay acts on it."""
    if isinstance(exc, pymysql.err.OperationalError | pymysql.err.InternalError):
        code = exc.args[0] if exc.args else None
        if code == ER_MASTER_FATAL_READING_BINLOG:
            return BinlogPurged(f"the server cannot send the binlog from here: {exc.args[-1]}")
        return BinlogConnectionError(f"binlog connection lost: {exc}")
    if isinstance(exc, pymysql.err.Error | OSError):
        return BinlogConnectionError(f"binlog connection lost: {exc}")
    if isinstance(exc, OutboxError) or not isinstance(exc, Exception):
        return exc
    # Anything else broke the stream (the library, mid-packet as the server went):
    # a new reader starts again from the confirmed position; the cause is shown
    # whole, each time, in case it is no passing thing.
    log.error("the binlog reader failed; reconnecting", exc_info=exc)
    error = BinlogConnectionError(f"the binlog reader failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
