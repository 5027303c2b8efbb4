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

import re
import select
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

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
    load_row,
)
from outbox_core.errors import ConfigurationError, DatabaseError, UnsupportedDatabase
from outbox_core.redaction import redact
from outbox_core.schema import validate_identifier

# --------------------------------------------------------------------------- errors


class SlotInUse(WalError):
    """Another connection is reading the slot (SQLSTATE 55006): retry later.

    A standby reader waits on this; the slot is free once the other reader's
    connection is gone (closed, or found dead within ``wal_sender_timeout``).
    """

    transient = True


class SlotMissing(WalError):
    """The replication slot does not exist (or is not a ``pgoutput`` slot of this database)."""


class SlotInvalidated(WalError):
    """The server dropped WAL the slot still needed (``wal_status = 'lost'``).

    ``max_slot_wal_keep_size`` was exceeded: changes after the slot's
    confirmed position are gone from the log. A new slot starts from now;
    what was committed in between must be found another way (polling).
    """


class PublicationMissing(WalError):
    """The publication named for the stream does not exist."""


class WalLevelNotLogical(WalError, UnsupportedDatabase):
    """The server's ``wal_level`` is not ``logical``: logical decoding is impossible."""


class ReplicationNotPermitted(WalError):
    """The role has neither the REPLICATION attribute nor superuser."""


class WalConnectionError(WalError, DatabaseError):
    """The replication connection could not be made or was lost; a new reader may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, unreachable=True)


# --------------------------------------------------------------------------- LSNs and names

_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> int."""
    high, sep, low = text.partition("/")
    try:
        if not sep:
            raise ValueError(text)
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise ConfigurationError(f"invalid LSN {text!r}: expected hex 'X/Y'") from None


def format_lsn(lsn: int) -> str:
    """int -> ``'16/B374D848'`` (PostgreSQL's spelling)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _lsn(value: object) -> int | None:
    return None if value is None else parse_lsn(str(value))


def validate_slot_name(name: str) -> str:
    """PostgreSQL's own rule for slot names: 1-63 lower-case letters, digits, underscores."""
    if not isinstance(name, str) or not _SLOT_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid replication slot name {name!r}: use 1-63 lower-case letters, "
            "digits or underscores"
        )
    return name


def quote_identifier(name: str, what: str) -> str:
    """A validated identifier, double-quoted (the case it was written in is kept)."""
    return '"' + validate_identifier(name, what) + '"'


def masked_url(url: str | sa.URL) -> str:
    """The URL with its password hidden: what errors and logs may show."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return redact(str(url))


# --------------------------------------------------------------------------- SQL helpers
# Ordinary statements on a normal (psycopg 3) connection; the caller owns the transaction.


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None) or exc
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return None if state is None else str(state)


def _failed(operation: str, exc: sa.exc.DBAPIError) -> WalError:
    """The typed error of a failed statement (the driver error's own text, password-free)."""
    detail = redact(f"{operation} failed: {getattr(exc, 'orig', None) or exc}")
    state = _sqlstate(exc)
    if state == "55000" and "wal_level" in detail:
        return WalLevelNotLogical(detail)
    if state == "42501":
        return ReplicationNotPermitted(detail)
    if state == "55006":
        return SlotInUse(detail)
    return WalError(detail)


def wal_level(conn: sa.Connection) -> str:
    """The server's ``wal_level`` (``minimal``, ``replica`` or ``logical``)."""
    return str(conn.execute(sa.text("SHOW wal_level")).scalar_one())


def require_logical_wal(conn: sa.Connection) -> None:
    """Raise :class:`WalLevelNotLogical` unless ``wal_level = logical``."""
    level = wal_level(conn)
    if level != "logical":
        raise WalLevelNotLogical(
            f"wal_level is {level!r}, logical decoding needs 'logical' "
            "(ALTER SYSTEM SET wal_level = logical, then restart the server)"
        )


def can_replicate(conn: sa.Connection) -> bool:
    """The current role may open replication connections (REPLICATION or superuser)."""
    return bool(
        conn.execute(
            sa.text("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user")
        ).scalar()
    )


def publication_exists(conn: sa.Connection, name: str) -> bool:
    """A publication of this name exists in the connection's database."""
    return (
        conn.execute(
            sa.text("SELECT 1 FROM pg_publication WHERE pubname = :name"), {"name": name}
        ).first()
        is not None
    )


def create_publication(
    conn: sa.Connection,
    name: str,
    *,
    table: str,
    schema: str = "public",
    publish: Sequence[str] = ("insert",),
) -> bool:
    """``CREATE PUBLICATION name FOR TABLE schema.table WITH (publish = ...)``.

    ``publish`` names the operations sent (``insert``, ``update``, ``delete``).
    False (and nothing done) when a publication of that name exists already.
    Create it before the slot: the slot decodes a change with the catalog of
    its time, and a publication younger than the change is not found.
    """
    operations = ", ".join(op for op in publish if op in ("insert", "update", "delete"))
    if not operations or len(operations.split(", ")) != len(publish):
        raise ConfigurationError(f"publish: insert, update or delete, not {list(publish)!r}")
    statement = (
        f"CREATE PUBLICATION {quote_identifier(name, 'publication name')} FOR TABLE "
        f"{quote_identifier(schema, 'schema name')}.{quote_identifier(table, 'table name')} "
        f"WITH (publish = '{operations}')"
    )
    if publication_exists(conn, name):
        return False
    try:
        conn.execute(sa.text(statement))
    except sa.exc.DBAPIError as exc:
        raise _failed(f"creating publication {name}", exc) from exc
    return True


def drop_publication(conn: sa.Connection, name: str) -> None:
    """``DROP PUBLICATION IF EXISTS name``."""
    conn.execute(
        sa.text(f"DROP PUBLICATION IF EXISTS {quote_identifier(name, 'publication name')}")
    )


def create_slot(conn: sa.Connection, name: str) -> int:
    """Create the logical slot ``name`` (plugin ``pgoutput``); the LSN it starts at.

    The statement waits for the transactions running elsewhere to end, and
    refuses to run in a transaction that has written anything.
    """
    try:
        lsn = conn.execute(
            sa.text("SELECT lsn FROM pg_create_logical_replication_slot(:name, 'pgoutput')"),
            {"name": validate_slot_name(name)},
        ).scalar_one()
    except sa.exc.DBAPIError as exc:
        raise _failed(f"creating replication slot {name}", exc) from exc
    return parse_lsn(str(lsn))


def drop_slot(conn: sa.Connection, name: str) -> bool:
    """Drop the slot ``name`` if it exists (:class:`SlotInUse` while a reader has it)."""
    if slot_facts(conn, validate_slot_name(name)) is None:
        return False
    try:
        conn.execute(sa.text("SELECT pg_drop_replication_slot(:name)"), {"name": name})
    except sa.exc.DBAPIError as exc:
        raise _failed(f"dropping replication slot {name}", exc) from exc
    return True


@dataclass(frozen=True)
class SlotFacts:
    """A replication slot as ``pg_replication_slots`` shows it, LSNs as ints.

    ``retained_bytes`` is the WAL the slot keeps on disk (current WAL
    position minus ``restart_lsn``); ``lag_bytes`` the WAL written since its
    confirmed position (what its reader has not confirmed yet, outbox or
    not); ``wal_status`` and ``safe_wal_size`` are ``None`` before
    PostgreSQL 13.
    """

    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    retained_bytes: int | None
    wal_status: str | None
    safe_wal_size: int | None
    lag_bytes: int | None = None


def slot_facts(conn: sa.Connection, name: str) -> SlotFacts | None:
    """The slot ``name``, or None when it does not exist."""
    newer = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
    # wal_status and safe_wal_size came with PostgreSQL 13.
    extra = "wal_status, safe_wal_size" if int(newer) >= 130000 else "NULL, NULL"
    current = (
        "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"
    )
    row = conn.execute(
        sa.text(
            "SELECT slot_name, plugin, slot_type, database, active, active_pid, "
            "restart_lsn::text, confirmed_flush_lsn::text, "
            f"pg_wal_lsn_diff({current}, restart_lsn)::bigint, {extra}, "
            f"pg_wal_lsn_diff({current}, confirmed_flush_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = :name"
        ),
        {"name": name},
    ).first()
    if row is None:
        return None
    return SlotFacts(
        name=row[0],
        plugin=row[1],
        slot_type=row[2],
        database=row[3],
        active=bool(row[4]),
        active_pid=row[5],
        restart_lsn=_lsn(row[6]),
        confirmed_flush_lsn=_lsn(row[7]),
        retained_bytes=None if row[8] is None else int(row[8]),
        wal_status=row[9],
        safe_wal_size=None if row[10] is None else int(row[10]),
        lag_bytes=None if row[11] is None else max(0, int(row[11])),
    )


def check_ready(
    conn: sa.Connection,
    *,
    slot: str,
    publication: str,
    table: tuple[str | None, str] | None = None,
) -> list[WalError]:
    """Every reason a :class:`WalStream` of ``slot`` / ``publication`` would be refused.

    An empty list when the server is ready: ``wal_level = logical``, the role
    may replicate, the slot exists as a ``pgoutput`` slot of this database
    that has kept its WAL, the publication exists and, given ``table``
    (schema, name; schema None: the current one), publishes that table's
    inserts and updates (a replay reaches the relay as an update).
    """
    problems: list[WalError] = []
    try:
        require_logical_wal(conn)
    except WalLevelNotLogical as exc:
        problems.append(exc)
    if not can_replicate(conn):
        problems.append(
            ReplicationNotPermitted(
                "the role has neither REPLICATION nor superuser (ALTER ROLE ... WITH REPLICATION)"
            )
        )
    facts = slot_facts(conn, slot)
    database = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    if facts is None:
        problems.append(SlotMissing(f"replication slot {slot!r} does not exist"))
    elif facts.plugin != "pgoutput" or facts.database != database:
        problems.append(
            SlotMissing(
                f"replication slot {slot!r} is not a pgoutput slot of database {database!r} "
                f"(plugin {facts.plugin!r}, database {facts.database!r})"
            )
        )
    elif facts.wal_status == "lost":
        problems.append(
            SlotInvalidated(
                f"replication slot {slot!r} lost WAL it needed (max_slot_wal_keep_size)"
            )
        )
    if not publication_exists(conn, publication):
        problems.append(PublicationMissing(f"publication {publication!r} does not exist"))
    elif table is not None:
        row = conn.execute(
            sa.text(
                "SELECT p.pubinsert, p.pubupdate, EXISTS (SELECT 1 FROM pg_publication_tables t "
                "WHERE t.pubname = p.pubname AND t.schemaname = COALESCE(:schema, "
                "current_schema()) AND t.tablename = :table) FROM pg_publication p "
                "WHERE p.pubname = :name"
            ),
            {"name": publication, "schema": table[0], "table": table[1]},
        ).one()
        missing = [what for what, ok in zip(("inserts", "updates"), row[:2], strict=True) if not ok]
        if not row[2]:
            missing.insert(0, f"table {table[1]!r}")
        if missing:
            problems.append(
                PublicationMissing(
                    f"publication {publication!r} does not publish {' or '.join(missing)} "
                    "(ALTER PUBLICATION ... ADD TABLE / SET (publish = 'insert, update'))"
                )
            )
    return problems


# --------------------------------------------------------------------------- the stream


@dataclass(frozen=True)
class WalRow:
    """One inserted row: its table, column name -> text value, column name -> type oid."""

    schema: str
    table: str
    values: Mapping[str, str | None] = field(hash=False)
    type_oids: Mapping[str, int] = field(hash=False)
    #: ``"insert"``, or ``"update"`` (only from a publication that publishes updates;
    #: an unchanged TOASTed column of an update is left out of ``values``).
    op: str = "insert"

    def loaded(self) -> dict[str, Any]:
        """The values as Python objects, by type oid (:func:`~.pgoutput.load_text`)."""
        return load_row(self.values, self.type_oids)


@dataclass(frozen=True)
class WalTransaction:
    """One committed transaction: its inserts of the watched tables, in statement order.

    ``end_lsn`` is the position to :meth:`WalStream.confirm` once every row
    is safely handled. ``rows`` may be empty: the transaction changed nothing
    watched, and confirming its ``end_lsn`` lets the slot free the WAL.
    """

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time: datetime
    rows: tuple[WalRow, ...]


@dataclass(frozen=True)
class StreamStart:
    """What the server and the slot told a reader before it started replication.

    ``system_id`` and ``timeline`` (``IDENTIFY_SYSTEM``) name the WAL
    history: a crash restart keeps both, a promoted standby or a
    point-in-time recovery starts a new timeline, another cluster has another
    system id. ``flush_lsn`` is the server's WAL flushed so far (nothing
    committed lies beyond it); ``slot_lsn`` the slot's confirmed position,
    as of its last save by the server after a crash.
    """

    slot: str
    system_id: str
    timeline: int
    flush_lsn: int
    slot_lsn: int


@dataclass
class _Open:
    begin: Begin
    rows: list[WalRow]


#: Session settings of the replication connection: values are written by the
#: server's output functions in the walsender's session, so these make them
#: what load_text expects whatever the server's defaults.
_SESSION = {
    "datestyle": "ISO",
    "timezone": "UTC",
    "intervalstyle": "postgres",
    "bytea_output": "hex",
    "extra_float_digits": "3",
}

#: The longest select() wait: read_message() sends due status updates only when called.
_MAX_WAIT = 1.0


def replication_conninfo(
    url: str | sa.URL,
    *,
    wal_sender_timeout: float | None = None,
    connect_timeout: float = 10.0,
    application_name: str = "outbox-wal-reader",
) -> dict[str, str]:
    """libpq keywords for psycopg2 from a SQLAlchemy URL (``postgresql+psycopg://...``).

    The URL's query (``sslmode``, ``host`` of a socket directory...) is kept;
    ``options`` gets the session settings the decoder relies on and, if
    given, ``wal_sender_timeout``: how long the server keeps the slot of a
    reader that stopped answering.
    """
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(f"not a PostgreSQL URL: {masked_url(parsed)}")
    args: dict[str, str] = {}
    for key, value in parsed.query.items():
        args[key] = value if isinstance(value, str) else ",".join(value)
    for key, value in parsed.translate_connect_args(username="user", database="dbname").items():
        args[key] = str(value)
    settings = dict(_SESSION)
    if wal_sender_timeout is not None:
        settings["wal_sender_timeout"] = f"{max(1, round(wal_sender_timeout * 1000))}ms"
    options = " ".join(f"-c {k}={v}" for k, v in settings.items())
    args["options"] = f"{args['options']} {options}" if "options" in args else options
    args["client_encoding"] = "UTF8"
    args["connect_timeout"] = str(max(1, round(connect_timeout)))
    args.setdefault("application_name", application_name)
    return args


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
        self._open: _Open | None = None
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
            slot_lsn=_lsn(confirmed) or 0,
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
            self._open = _Open(message, [])
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

    def _require_open(self, what: str) -> _Open:
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
