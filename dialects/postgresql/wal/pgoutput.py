"""Decoder of the ``pgoutput`` logical replication protocol, version 1.

One message of the stream (the payload of one ``XLogData``) becomes one
frozen dataclass: :class:`Begin`, :class:`Commit`, :class:`Relation`,
:class:`Insert`, :class:`Update`, :class:`Delete`, :class:`Truncate`,
:class:`Type`, :class:`Origin`, :class:`LogicalMessage`; the kinds of later
protocol versions (streamed and two-phase transactions) come back as
:class:`Other` so a reader can skip them. Framing is big-endian; strings are
NUL-terminated and UTF-8 (the reader asks for ``client_encoding=UTF8``).

Column values stay text, as the server wrote them with each type's output
function: :func:`load_text` turns one into a Python value by the column's
type oid, with psycopg 3's own loaders.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, Literal, TypeAlias

from outbox_core.errors import OutboxError

#: Where PostgreSQL timestamps count from (microseconds, UTC).
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


class WalError(OutboxError):
    """Base class of the log-tailing reader's errors."""


class WalDecodeError(WalError, ValueError):
    """A pgoutput message is malformed: truncated, too long or of an unknown kind."""


class Unchanged(enum.Enum):
    """A column value the server did not send: an unchanged TOASTed value (``'u'``)."""

    TOAST = "u"


#: One column of a tuple: text, ``None`` for SQL NULL, or :attr:`Unchanged.TOAST`.
ColumnValue: TypeAlias = str | Literal[Unchanged.TOAST] | None
#: The columns of one row, in the relation's column order.
TupleData: TypeAlias = tuple[ColumnValue, ...]


@dataclass(frozen=True)
class Begin:
    """``B``: a transaction starts; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: int
    commit_time: datetime
    xid: int


@dataclass(frozen=True)
class Commit:
    """``C``: the transaction commits; ``end_lsn`` is the position to confirm past it."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: datetime


@dataclass(frozen=True)
class Origin:
    """``O``: the transaction was replicated from another origin."""

    commit_lsn: int
    name: str


@dataclass(frozen=True)
class Column:
    """One column of a :class:`Relation`."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """The column is part of the replica identity (flag 1)."""
        return bool(self.flags & 1)


@dataclass(frozen=True)
class Relation:
    """``R``: a table's shape, sent before its first change in a session and after DDL."""

    relid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]

    @property
    def schema(self) -> str:
        """The schema name: the protocol sends ``''`` for ``pg_catalog``."""
        return self.namespace or "pg_catalog"

    @property
    def type_oids(self) -> dict[str, int]:
        """Column name -> type oid."""
        return {c.name: c.type_oid for c in self.columns}

    def row(self, values: TupleData) -> dict[str, ColumnValue]:
        """Column name -> value of one tuple of this relation."""
        if len(values) != len(self.columns):
            raise WalDecodeError(
                f"tuple of {len(values)} columns for relation {self.schema}.{self.name} "
                f"of {len(self.columns)}"
            )
        return {c.name: v for c, v in zip(self.columns, values, strict=True)}


@dataclass(frozen=True)
class Type:
    """``Y``: a non-built-in data type used by a following relation."""

    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    """``I``: a row was inserted."""

    relid: int
    new: TupleData


@dataclass(frozen=True)
class Update:
    """``U``: a row was updated; ``old`` is sent only with a key change or ``REPLICA IDENTITY``.

    ``old_kind`` is ``'K'`` (key columns only), ``'O'`` (the whole old row) or ``None``.
    """

    relid: int
    old_kind: str | None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True)
class Delete:
    """``D``: a row was deleted; ``old_kind`` is ``'K'`` (key columns) or ``'O'`` (whole row)."""

    relid: int
    old_kind: str
    old: TupleData


@dataclass(frozen=True)
class Truncate:
    """``T``: tables were truncated."""

    options: int
    relids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        """``TRUNCATE ... CASCADE``."""
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        """``TRUNCATE ... RESTART IDENTITY``."""
        return bool(self.options & 2)


@dataclass(frozen=True)
class LogicalMessage:
    """``M``: a ``pg_logical_emit_message()`` (sent only with the ``messages`` option)."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True)
class Other:
    """A message of a later protocol version (streamed or two-phase transactions), undecoded."""

    kind: str
    payload: bytes


Message: TypeAlias = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
    | Other
)

#: Kinds of protocol versions 2-4: stream start/stop/commit/abort, begin prepare,
#: prepare, commit/rollback prepared, stream prepare. Never sent to a version 1 reader.
_LATER_KINDS = frozenset(b"SEcAbPKrp")

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_U64 = struct.Struct("!Q")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")


class _Reader:
    """A cursor over one message's bytes; every read checks the length first."""

    __slots__ = ("data", "kind", "pos")

    def __init__(self, data: bytes, kind: str) -> None:
        self.data = data
        self.kind = kind
        self.pos = 1

    def _take(self, size: int) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise WalDecodeError(
                f"truncated {self.kind!r} message: {size} more bytes needed at offset "
                f"{start}, {len(self.data) - start} left"
            )
        self.pos = start + size
        return start

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack_from(self.data, self._take(fmt.size))

    def u8(self) -> int:
        return int(self.unpack(_U8)[0])

    def u16(self) -> int:
        return int(self.unpack(_U16)[0])

    def i32(self) -> int:
        return int(self.unpack(_I32)[0])

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def i64(self) -> int:
        return int(self.unpack(_I64)[0])

    def u64(self) -> int:
        return int(self.unpack(_U64)[0])

    def byte(self) -> str:
        return chr(self.u8())

    def raw(self, size: int) -> bytes:
        start = self._take(size)
        return self.data[start : start + size]

    def text(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WalDecodeError(f"{self.kind!r} message holds text that is not UTF-8") from exc

    def cstring(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise WalDecodeError(f"unterminated string in {self.kind!r} message")
        raw = self.data[self.pos : end]
        self.pos = end + 1
        return self.text(raw)

    def timestamp(self, micros: int) -> datetime:
        try:
            return PG_EPOCH + timedelta(microseconds=micros)
        except OverflowError as exc:
            raise WalDecodeError(f"timestamp {micros} out of range in {self.kind!r}") from exc

    def tuple_data(self) -> TupleData:
        # The hot loop of log tailing (one pass per column of every row): bytes
        # indexed in place, the same bound checks as _take, no call per field.
        data, pos, end = self.data, self.pos, len(self.data)
        if pos + 2 > end:
            self._take(2)
        count = data[pos] << 8 | data[pos + 1]
        pos += 2
        values: list[ColumnValue] = []
        append = values.append
        for _ in range(count):
            if pos >= end:
                self.pos = pos
                self._take(1)
            kind = data[pos]
            pos += 1
            if kind == 0x74:  # 't': text
                if pos + 4 > end:
                    self.pos = pos
                    self._take(4)
                size = int.from_bytes(data[pos : pos + 4], "big")
                pos += 4
                stop = pos + size
                if stop > end:
                    self.pos = pos
                    self._take(size)
                append(self.text(data[pos:stop]))
                pos = stop
            elif kind == 0x6E:  # 'n': null
                append(None)
            elif kind == 0x75:  # 'u': unchanged TOAST
                append(Unchanged.TOAST)
            elif kind == 0x62:  # 'b': only sent with the 'binary' option, never asked for
                raise WalDecodeError("binary column value: the 'binary' option is not supported")
            else:
                raise WalDecodeError(f"unknown column kind {chr(kind)!r} in {self.kind!r} message")
        self.pos = pos
        return tuple(values)

    def done(self) -> None:
        if self.pos != len(self.data):
            raise WalDecodeError(
                f"{len(self.data) - self.pos} unexpected trailing bytes in {self.kind!r} message"
            )


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """Decode one pgoutput (protocol version 1) message; :class:`WalDecodeError` if malformed."""
    data = bytes(data)
    if not data:
        raise WalDecodeError("empty pgoutput message")
    kind = chr(data[0])
    r = _Reader(data, kind)
    message: Message
    if kind == "B":
        final_lsn, ts, xid = r.unpack(_BEGIN)
        message = Begin(final_lsn, r.timestamp(ts), xid)
    elif kind == "C":
        flags, commit_lsn, end_lsn, ts = r.unpack(_COMMIT)
        message = Commit(flags, commit_lsn, end_lsn, r.timestamp(ts))
    elif kind == "O":
        message = Origin(r.u64(), r.cstring())
    elif kind == "R":
        relid, namespace, name, identity = r.u32(), r.cstring(), r.cstring(), r.byte()
        columns = tuple(Column(r.u8(), r.cstring(), r.u32(), r.i32()) for _ in range(r.u16()))
        message = Relation(relid, namespace, name, identity, columns)
    elif kind == "Y":
        message = Type(r.u32(), r.cstring(), r.cstring())
    elif kind == "I":
        relid = r.u32()
        _expect(r, "N")
        message = Insert(relid, r.tuple_data())
    elif kind == "U":
        relid = r.u32()
        marker = r.byte()
        old_kind: str | None = None
        old: TupleData | None = None
        if marker in ("K", "O"):
            old_kind, old = marker, r.tuple_data()
            marker = r.byte()
        if marker != "N":
            raise WalDecodeError(f"expected 'N' in 'U' message, got {marker!r}")
        message = Update(relid, old_kind, old, r.tuple_data())
    elif kind == "D":
        relid = r.u32()
        marker = r.byte()
        if marker not in ("K", "O"):
            raise WalDecodeError(f"expected 'K' or 'O' in 'D' message, got {marker!r}")
        message = Delete(relid, marker, r.tuple_data())
    elif kind == "T":
        count = r.u32()
        options = r.u8()
        message = Truncate(options, tuple(r.u32() for _ in range(count)))
    elif kind == "M":
        flags, lsn, prefix = r.u8(), r.u64(), r.cstring()
        message = LogicalMessage(bool(flags & 1), lsn, prefix, r.raw(r.u32()))
    elif data[0] in _LATER_KINDS:
        return Other(kind, data)
    else:
        raise WalDecodeError(f"unknown pgoutput message kind {kind!r}")
    r.done()
    return message


def _expect(r: _Reader, marker: str) -> None:
    got = r.byte()
    if got != marker:
        raise WalDecodeError(f"expected {marker!r} in {r.kind!r} message, got {got!r}")


@lru_cache(maxsize=256)
def _loader(type_oid: int) -> Any:
    # Imported here: the decoder itself needs no driver. A Transformer without a
    # connection uses psycopg's global adapters (UTC for timestamptz, UTF-8 text);
    # an oid it does not know gets the text loader, so the value stays a str.
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    return Transformer().get_loader(type_oid, Format.TEXT)


def load_text(value: ColumnValue, type_oid: int) -> Any:
    """A column's text value as Python, by its type oid (psycopg 3's text loaders).

    int2/int4/int8 -> int, bool -> bool, uuid -> UUID, json/jsonb -> parsed JSON,
    timestamptz -> aware datetime, timestamp -> naive datetime, bytea -> bytes,
    text/varchar and unknown types -> str. ``None`` (NULL) stays ``None``. The
    server must send ISO dates and hex bytea (the reader's session settings).
    """
    if value is None:
        return None
    if value is Unchanged.TOAST:
        raise WalDecodeError("an unchanged TOAST value has no text to load")
    try:
        return _loader(type_oid).load(value.encode("utf-8"))
    except Exception as exc:  # the loaders raise psycopg.DataError, ValueError...
        raise WalDecodeError(f"cannot load {value[:40]!r} as type oid {type_oid}: {exc}") from exc


def load_row(values: Mapping[str, ColumnValue], type_oids: Mapping[str, int]) -> dict[str, Any]:
    """Every column of a row through :func:`load_text`."""
    return {name: load_text(value, type_oids[name]) for name, value in values.items()}
