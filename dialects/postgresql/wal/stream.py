"""The replication client: a logical slot read through psycopg2, whole transactions out.

The slot (plugin ``pgoutput``) and a publication of the watched table are made
with ordinary SQL (:func:`create_publication`, :func:`create_slot`) on the
project's psycopg 3 engine; :class:`WalStream` then reads the slot over a
``replication=database`` connection with psycopg2's
:class:`~psycopg2.extras.LogicalReplicationConnection`, which frames
COPY_BOTH, answers the server's keepalives inside ``read_message()`` and sends
standby status updates.

Guarantees the caller builds on:

* transactions come out whole and in commit order (pgoutput version 1 sends
  a transaction only once it has committed);
* the slot's confirmed position moves only through :meth:`WalStream.confirm`
  (and psycopg2's forwarding of it over WAL that carried nothing, see
  :meth:`WalStream.confirm`): whatever was not confirmed is sent again by the
  next reader of the slot (at least once);
* one reader per slot: another gets :class:`SlotInUse` until the first one's
  connection is gone;
* a reader started at a position (``start_lsn``, or ``choose_start``'s answer)
  never hands out a transaction that committed before it, even where the
  slot's own confirmed position is older (a crash loses a confirmation the
  server had not saved yet).
"""

from __future__ import annotations

import select
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from outbox_core.dialects.postgresql.wal.conninfo import replication_conninfo
from outbox_core.dialects.postgresql.wal.errors import (
    PublicationMissing,
    ReplicationNotPermitted,
    SlotInUse,
    SlotInvalidated,
    SlotMissing,
    WalConnectionError,
    WalLevelNotLogical,
)
from outbox_core.dialects.postgresql.wal.names import (
    format_lsn,
    lsn_or_none,
    masked_url,
    parse_lsn,
    validate_slot_name,
)
from outbox_core.dialects.postgresql.wal.pgoutput import (
    Begin,
    Commit,
    Insert,
    Relation,
    Unchanged,
    Update,
    WalDecodeError,
    WalError,
    decode_message,
)
from outbox_core.dialects.postgresql.wal.rows import StreamStart, WalRow, WalTransaction
from outbox_core.errors import ConfigurationError
from outbox_core.identifiers import validate_identifier
from outbox_core.redaction import redact


@dataclass
class _Receiving:
    """A transaction being received: its BEGIN, and its rows so far."""

    begin: Begin
    rows: list[WalRow]


#: The longest select() wait: read_message() sends due status updates only when called.
_MAX_WAIT = 1.0


class WalStream:
    """Committed transactions read from a logical slot, in commit order.

    Connects and starts replication in the constructor (refusals are typed:
    :class:`SlotInUse`, :class:`SlotMissing`, :class:`PublicationMissing`,
    :class:`WalLevelNotLogical`, :class:`ReplicationNotPermitted`,
    :class:`WalConnectionError`). ``start_lsn`` ``None`` starts at the slot's
    confirmed position; an earlier one is raised to it by the server; a later
    one skips every transaction that committed before it. ``choose_start``,
    if given, picks the start instead, once the server and the slot are
    checked: it gets their :class:`StreamStart` and answers a position (0:
    the slot's). A start beyond the server's flushed WAL is refused
    (:class:`~outbox_core.errors.ConfigurationError`): it would skip what is
    committed later. :attr:`start_lsn` is where the stream started.
    ``tables`` ((schema, table) pairs) limits the rows reported; ``None``
    reports every insert the publication sends.

    Call :meth:`read` (or :meth:`keep_alive`) at least every
    ``wal_sender_timeout / 2``: the server's keepalives are answered only
    then, and a reader that stays silent longer is cut off. One thread at a
    time. After any error but a timeout the stream is done: close it and
    open a new one, which starts again at the slot's confirmed position.
    """

    def __init__(
        self,
        url: str | sa.URL,
        *,
        slot: str,
        publication: str | Sequence[str],
        tables: Iterable[tuple[str, str]] | None = None,
        start_lsn: int | str | None = None,
        choose_start: Callable[[StreamStart], int] | None = None,
        wal_sender_timeout: float | None = None,
        connect_timeout: float = 10.0,
        status_interval: float = 10.0,
        application_name: str = "outbox-wal-reader",
    ) -> None:
        try:
            import psycopg2
            import psycopg2.extras
        except ImportError as exc:  # an optional dependency: the reader alone needs it
            raise ConfigurationError(
                "reading a replication slot needs psycopg2: pip install 'outbox-toolkit[wal]'"
            ) from exc

        self._pg = psycopg2
        self.slot = validate_slot_name(slot)
        self.publications = (publication,) if isinstance(publication, str) else tuple(publication)
        for name in self.publications:
            validate_identifier(name, "publication name")
        self.tables = None if tables is None else frozenset(tables)
        self.url = masked_url(url)
        self._relations: dict[int, Relation] = {}
        self._open: _Receiving | None = None
        self._ready: deque[WalTransaction] = deque()
        self._received = 0  # end LSN of the last whole transaction received
        self._confirmed = 0
        self._server_end = 0
        self._closed = False
        #: What the server and the slot told before replication started.
        self.started: StreamStart | None = None
        self._start_lsn = 0
        if start_lsn is None:
            start = 0  # the server starts at the slot's confirmed position
        elif isinstance(start_lsn, str):
            start = parse_lsn(start_lsn)
        else:
            start = int(start_lsn)
        conninfo = replication_conninfo(
            url,
            wal_sender_timeout=wal_sender_timeout,
            connect_timeout=connect_timeout,
            application_name=application_name,
        )
        try:
            self._conn = psycopg2.connect(
                connection_factory=psycopg2.extras.LogicalReplicationConnection, **conninfo
            )
        except psycopg2.Error as exc:
            raise self._connect_error(exc) from exc
        try:
            self._cursor = self._conn.cursor()
            self.started = self._check()
            if choose_start is not None:
                start = choose_start(self.started)
            if start > self.started.flush_lsn:
                # Nothing is committed there yet: starting there would skip what comes.
                raise ConfigurationError(
                    f"{self._where()}: cannot start at {format_lsn(start)}, beyond the "
                    f"server's WAL ({format_lsn(self.started.flush_lsn)})"
                )
            # Transactions that committed before the start are skipped here too
            # (the server skips them as well).
            self._start_lsn = max(start, self.started.slot_lsn)
            self._start(start, status_interval)
        except BaseException:
            self._conn.close()
            self._closed = True
            raise

    # -- setup

    def _where(self) -> str:
        return f"slot {self.slot!r} on {self.url}"

    def _connect_error(self, exc: Exception) -> WalError:
        text = redact(str(exc).strip())
        # A refused walsender is a FATAL at login, without SQLSTATE in psycopg2:
        # PostgreSQL <= 15 says "replication role", 16+ "permission denied to start WAL sender".
        if "replication role" in text or "start WAL sender" in text:
            return ReplicationNotPermitted(f"{self._where()}: {text}")
        return WalConnectionError(f"cannot connect to {self._where()}: {text}")

    def _query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        try:
            self._cursor.execute(sql, params)
            return list(self._cursor.fetchall())
        except self._pg.Error as exc:
            raise self._stream_error(exc) from exc

    def _check(self) -> StreamStart:
        """Plain reasons to refuse, asked before START_REPLICATION names them less clearly;
        then the server's WAL history and position, and the slot's."""
        # A replication=database connection runs simple SQL until replication starts.
        level, database = self._query("SELECT current_setting('wal_level'), current_database()")[0]
        if level != "logical":
            raise WalLevelNotLogical(
                f"{self._where()}: wal_level is {level!r}, logical decoding needs 'logical'"
            )
        # to_jsonb: wal_status only exists from PostgreSQL 13 on.
        slots = self._query(
            "SELECT plugin, database, to_jsonb(s)->>'wal_status', confirmed_flush_lsn::text "
            "FROM pg_replication_slots s WHERE slot_name = %s",
            (self.slot,),
        )
        if not slots:
            raise SlotMissing(f"{self._where()}: the replication slot does not exist")
        plugin, slot_database, status, confirmed = slots[0]
        if (plugin, slot_database) != ("pgoutput", database):
            raise SlotMissing(
                f"{self._where()}: not a pgoutput slot of database {database!r} "
                f"(plugin {plugin!r}, database {slot_database!r})"
            )
        if status == "lost":
            raise SlotInvalidated(
                f"{self._where()}: the slot lost WAL it needed (max_slot_wal_keep_size)"
            )
        found = {
            row[0]
            for row in self._query(
                "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                (list(self.publications),),
            )
        }
        missing = [name for name in self.publications if name not in found]
        if missing:
            raise PublicationMissing(
                f"{self._where()}: publication {', '.join(missing)} does not exist"
            )
        # A replication command: the WAL history this server is on and its flushed end.
        system_id, timeline, flushed, _ = self._query("IDENTIFY_SYSTEM")[0]
        return StreamStart(
            slot=self.slot,
            system_id=str(system_id),
            timeline=int(timeline),
            flush_lsn=parse_lsn(str(flushed)),
            slot_lsn=lsn_or_none(confirmed) or 0,
        )

    def _start(self, start: int, status_interval: float) -> None:
        names = ",".join(f'"{name}"' for name in self.publications)
        try:
            self._cursor.start_replication(
                slot_name=self.slot,
                decode=False,
                start_lsn=start,
                options={"proto_version": "1", "publication_names": names},
                status_interval=status_interval,
            )
        except self._pg.Error as exc:
            raise self._stream_error(exc) from exc

    def _stream_error(self, exc: Exception) -> WalError:
        state = getattr(exc, "pgcode", None)
        text = redact(str(exc).strip())
        where = self._where()
        if state == "55006":
            return SlotInUse(f"{where}: {text}")
        if state == "42704" and "publication" in text:
            return PublicationMissing(f"{where}: {text}")
        if state == "42704":
            return SlotMissing(f"{where}: {text}")
        if state == "55000" and "wal_level" in text:
            return WalLevelNotLogical(f"{where}: {text}")
        if state == "55000" and ("no longer get changes" in text or "invalidated" in text):
            return SlotInvalidated(f"{where}: {text}")
        if state == "42501":
            return ReplicationNotPermitted(f"{where}: {text}")
        # No SQLSTATE (libpq lost the socket: "error with status PGRES_COPY_BOTH and no
        # message"), connection exceptions (08) and shutdown/crash (57P): the server is
        # going or gone, so a new reader later may succeed.
        if state is None or state[:2] == "08" or state[:3] == "57P" or self._conn.closed:
            return WalConnectionError(f"{where}: replication connection lost: {text}")
        return WalError(f"{where}: {text}")

    # -- reading

    @property
    def server_wal_end(self) -> int:
        """The furthest server WAL position seen (keepalives and data), 0 before any."""
        return self._server_end

    @property
    def confirmed_lsn(self) -> int:
        """The highest position given to :meth:`confirm` (0 before any)."""
        return self._confirmed

    @property
    def received_lsn(self) -> int:
        """``end_lsn`` of the last whole transaction received (returned or queued)."""
        return self._received

    @property
    def start_lsn(self) -> int:
        """Where the stream started: no transaction that committed before it comes."""
        return self._start_lsn

    @property
    def read_lsn(self) -> int:
        """How far the server's log has been read: the last transaction received, or the
        WAL end of the server's last message, whichever is later."""
        return max(self._received, self._server_end, self._start_lsn)

    @property
    def idle_lsn(self) -> int | None:
        """The server's WAL end when nothing received is left unconfirmed, else None.

        Confirming it when idle lets the slot drop the WAL of changes nobody
        watches (an idle slot otherwise retains WAL for ever). None while a
        transaction is half received, one is waiting to be read, or a
        received one is not confirmed.
        """
        # Transactions skipped before the start count as confirmed.
        confirmed = max(self._confirmed, self._start_lsn)
        if self._open is not None or self._ready or confirmed < self._received:
            return None
        return self._server_end if self._server_end > self._confirmed else None

    def _poll(self) -> bool:
        """Handle every message already arrived (keepalives are answered inside)."""
        if self._closed:
            raise WalError(f"{self._where()}: the stream is closed")
        got = False
        while True:
            try:
                msg = self._cursor.read_message()
            except self._pg.Error as exc:
                raise self._stream_error(exc) from exc
            self._server_end = max(self._server_end, int(self._cursor.wal_end))
            if msg is None:
                return got
            got = True
            self._handle(msg.payload)
            if self._ready:  # hand out whole transactions before reading on
                return got

    def _handle(self, payload: bytes) -> None:
        message = decode_message(payload)
        if isinstance(message, Begin):
            if self._open is not None:
                raise WalDecodeError(f"BEGIN of xid {message.xid} inside an open transaction")
            self._open = _Receiving(message, [])
        elif isinstance(message, Relation):
            self._relations[message.relid] = message
        elif isinstance(message, Insert):
            self._insert(message)
        elif isinstance(message, Update):
            self._update(message)
        elif isinstance(message, Commit):
            opened = self._require_open("COMMIT")
            if message.commit_lsn != opened.begin.final_lsn:
                raise WalDecodeError(
                    f"COMMIT at {format_lsn(message.commit_lsn)} of a transaction announced "
                    f"to commit at {format_lsn(opened.begin.final_lsn)}"
                )
            self._open = None
            self._received = message.end_lsn
            if message.commit_lsn < self._start_lsn:
                return  # before the start: settled by an earlier reader
            self._ready.append(
                WalTransaction(
                    xid=opened.begin.xid,
                    commit_lsn=message.commit_lsn,
                    end_lsn=message.end_lsn,
                    commit_time=message.commit_time,
                    rows=tuple(opened.rows),
                )
            )
        # Delete, Truncate, Type, Origin, messages: not what an outbox reads.

    def _require_open(self, what: str) -> _Receiving:
        if self._open is None:
            raise WalDecodeError(f"{what} outside a transaction")
        return self._open

    def _insert(self, message: Insert) -> None:
        opened = self._require_open("INSERT")
        relation = self._relations.get(message.relid)
        if relation is None:
            raise WalDecodeError(f"INSERT into relation {message.relid} never described")
        if self.tables is not None and (relation.schema, relation.name) not in self.tables:
            return
        values: dict[str, str | None] = {}
        for name, value in relation.row(message.new).items():
            if value is Unchanged.TOAST:
                raise WalDecodeError(f"INSERT into {relation.name} with an unchanged TOAST value")
            values[name] = value
        opened.rows.append(WalRow(relation.schema, relation.name, values, relation.type_oids))

    def _update(self, message: Update) -> None:
        """An updated row's new values (a replay re-entering the stream); TOAST left out."""
        opened = self._require_open("UPDATE")
        relation = self._relations.get(message.relid)
        if relation is None:
            raise WalDecodeError(f"UPDATE of relation {message.relid} never described")
        if self.tables is not None and (relation.schema, relation.name) not in self.tables:
            return
        values = {
            name: value
            for name, value in relation.row(message.new).items()
            if value is not Unchanged.TOAST
        }
        row = WalRow(relation.schema, relation.name, values, relation.type_oids, op="update")
        opened.rows.append(row)

    def read(self, timeout: float) -> WalTransaction | None:
        """The next committed transaction, or None if none completed within ``timeout`` s."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._poll():
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                select.select([self._cursor], [], [], min(remaining, _MAX_WAIT))
            except (OSError, ValueError) as exc:  # the socket was closed under us
                raise WalConnectionError(f"{self._where()}: {exc}") from exc

    def transactions(self, idle_timeout: float) -> Iterator[WalTransaction]:
        """Transactions as they come, until none arrives for ``idle_timeout`` seconds."""
        while (txn := self.read(idle_timeout)) is not None:
            yield txn

    def keep_alive(self) -> None:
        """Answer the server without waiting (for long work between reads, an outage).

        Reads on only until one whole transaction waits for :meth:`read`:
        a reader that paused must not buffer the log in memory (TCP then
        holds the server back). Past that, a status update alone keeps the
        server from timing the reader out.
        """
        while not self._ready and self._poll():
            pass
        if self._ready:
            try:
                self._cursor.send_feedback(force=True)
            except self._pg.Error as exc:
                raise self._stream_error(exc) from exc

    def confirm(self, lsn: int) -> None:
        """Tell the server everything up to ``lsn`` is handled: the slot may move past it.

        ``lsn`` is a transaction's ``end_lsn`` (or :attr:`idle_lsn`, or
        :attr:`start_lsn`: moving the slot to the start at once); a lower
        value than already confirmed changes nothing. The next reader of the
        slot starts after it. Sent at once, asking the server for a keepalive
        back (which refreshes :attr:`server_wal_end`).

        psycopg2 then forwards the flush position to the WAL end of later
        keepalives by itself for as long as no data message arrives after
        the confirmed one: WAL that carried nothing to this reader. What
        arrives and is not confirmed is never passed.
        """
        sent = max(self._received, self._server_end, self._start_lsn)
        if lsn > sent:
            raise ValueError(
                f"cannot confirm {format_lsn(lsn)}: beyond anything the server sent "
                f"or the start ({format_lsn(sent)})"
            )
        if self._closed:
            raise WalError(f"{self._where()}: the stream is closed")
        try:
            self._cursor.send_feedback(write_lsn=lsn, flush_lsn=lsn, reply=True, force=True)
        except self._pg.Error as exc:
            raise self._stream_error(exc) from exc
        self._confirmed = max(self._confirmed, lsn)

    def close(self) -> None:
        """Close the connection: the server releases the slot as the walsender exits."""
        if not self._closed:
            self._closed = True
            self._conn.close()

    @property
    def closed(self) -> bool:
        """The stream was closed."""
        return self._closed

    def __enter__(self) -> WalStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
